"""MIG layouts on the agent: the real MigApplier (and the Agent around it) against the stand-in
nvidia-smi and pynvml (tests/standins), over one state file per test."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest

from rackplane_agent import mig as agent_mig
from rackplane_agent.mig import MigApplier
from rackplane_agent.runner import Agent
from rackplane_wire import MigLayout, MigSlot
from tests.fixtures.agent import FakeClient, assignment, assignments, config, python, step_until
from tests.standins import BIN
from tests.standins import pynvml as fake_nvml

sys.path.insert(0, str(BIN.parent))
import nvidia_smi as fake_smi  # noqa: E402  (the stand-in's own module, for its state helpers)

pytestmark = pytest.mark.no_db

H100 = "NVIDIA H100 80GB HBM3"
BALANCED = [("3g.40gb", 4), ("2g.20gb", 2), ("1g.10gb", 0), ("1g.10gb", 1)]


@pytest.fixture
def host(tmp_path, monkeypatch):
    """Two whole, idle H100s behind the stand-in; `host.log()` is the argv of every call."""
    state = tmp_path / "gpus.json"
    fake_smi.new_state(str(state), [H100, H100])
    calls = tmp_path / "smi.log"
    monkeypatch.setenv("RACKPLANE_FAKE_GPU_STATE", str(state))
    monkeypatch.setenv("FAKE_SMI_LOG", str(calls))
    monkeypatch.setenv("FAKE_SMI_PYTHON", sys.executable)
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("FAKE_SMI_PLACEMENT", raising=False)

    class Host:
        path = state

        def log(self, clear: bool = True) -> list[list[str]]:
            lines = calls.read_text().splitlines() if calls.exists() else []
            if clear:
                calls.unlink(missing_ok=True)
            return [json.loads(x) for x in lines]

        def gpu(self, i: int) -> dict:
            return json.loads(state.read_text())["gpus"][i]

        def edit(self, i: int, **values) -> None:
            data = json.loads(state.read_text())
            data["gpus"][i].update(values)
            state.write_text(json.dumps(data))

    return Host()


def layout(lid: str, slots=BALANCED, gpu: int = 0, mig: bool = True) -> MigLayout:
    return MigLayout(
        id=lid, gpu=gpu, mig_mode=mig, instances=[MigSlot(profile=p, start=s) for p, s in slots]
    )


def applier(root: Path) -> MigApplier:
    return MigApplier(root / "mig", fake_nvml)


def only_report(a: MigApplier):
    (pending,) = a.pending()
    return pending[0]


APPS = ["--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"]
MODES = ["-i", "0", "--query-gpu=mig.mode.current,mig.mode.pending", "--format=csv,noheader"]


def test_whole_to_balanced_to_whole(host, tmp_path):
    a = applier(tmp_path)
    assert a.able and a.advance([layout("l1")], set(), False) is True
    assert host.log() == [
        APPS,
        ["-i", "0", "-mig", "1"],
        MODES,
        ["mig", "-i", "0", "-cgi", "1g.10gb,1g.10gb,2g.20gb,3g.40gb", "-C"],
    ]
    report = only_report(a)
    assert (report.id, report.gpu, report.status, report.mig_mode) == ("l1", 0, "applied", True)
    got = sorted((m.profile, m.start) for m in report.instances)
    assert got == sorted(BALANCED)
    cis = [ci["uuid"] for gi in host.gpu(0)["gis"] for ci in gi["cis"]]
    assert sorted(m.uuid for m in report.instances) == sorted(cis) and len(set(cis)) == 4
    assert all(u.startswith("MIG-") for u in cis) and host.gpu(1)["mig_current"] == 0
    a.acked([(0, "l1", 1)])
    assert a.pending() == [] and a.advance([layout("l1")], set(), False) is False
    assert host.log() == [], "a layout is applied once per id"

    assert a.advance([layout("l2", [], mig=False)], set(), False) is True
    assert host.log() == [
        APPS,
        ["mig", "-i", "0", "-dci"],
        ["mig", "-i", "0", "-dgi"],
        ["-i", "0", "-mig", "0"],
        MODES,
    ]
    report = only_report(a)
    assert (report.id, report.status, report.mig_mode, report.instances) == (
        "l2",
        "applied",
        False,
        [],
    )
    assert host.gpu(0)["mig_current"] == 0 and host.gpu(0)["gis"] == []


def test_the_report_has_the_starts_read_back(host, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_PLACEMENT", "highest")
    a = applier(tmp_path)
    a.advance([layout("one", [("1g.10gb", 0)], gpu=1)], set(), False)
    report = only_report(a)
    assert report.status == "applied" and [(m.profile, m.start) for m in report.instances] == [
        ("1g.10gb", 6)
    ], "the driver chose slot 6; the report says so, not the 0 asked for"
    # The balanced layout in start order runs out of room when the driver takes the highest
    # start: everything is destroyed and the layout created largest first.
    host.log()
    a.advance([layout("bal")], set(), False)
    calls = host.log()
    assert [c for c in calls if "-cgi" in c] == [
        ["mig", "-i", "0", "-cgi", "1g.10gb,1g.10gb,2g.20gb,3g.40gb", "-C"],
        ["mig", "-i", "0", "-cgi", "3g.40gb,2g.20gb,1g.10gb,1g.10gb", "-C"],
    ]
    assert calls.index(["mig", "-i", "0", "-dgi"]) > calls.index(calls[3])
    report = next(r for r, gpu, _, _ in a.pending() if gpu == 0)
    assert report.status == "applied"
    assert sorted((m.profile, m.start) for m in report.instances) == sorted(BALANCED)


def test_a_busy_gpu_is_refused_and_left_alone(host, tmp_path):
    host.edit(0, pids=[4242])
    a = applier(tmp_path)
    a.advance([layout("l1")], set(), False)
    report = only_report(a)
    assert (report.status, report.detail) == ("refused", "busy: pid 4242")
    assert host.log() == [APPS] and host.gpu(0)["mig_current"] == 0


def test_a_layout_outside_the_geometry_is_refused_without_a_command(host, tmp_path):
    a = applier(tmp_path)
    bad = [
        layout("overlap", [("3g.40gb", 4), ("4g.40gb", 0), ("1g.10gb", 6)]),
        layout("start", [("2g.20gb", 1)], gpu=1),
    ]
    a.advance(bad, set(), False)
    got = {r.id: (r.status, r.detail) for r, *_ in a.pending()}
    assert got == {
        "overlap": (
            "refused",
            "3g.40gb@4, 4g.40gb@0, 1g.10gb@6 is not a valid MIG layout on H100-80GB",
        ),
        "start": ("refused", "2g.20gb@1 is not a valid MIG layout on H100-80GB"),
    }
    a.advance([layout("h200-name", [("3g.71gb", 0)])], set(), False)
    ((r, *_),) = [p for p in a.pending() if p[0].id == "h200-name"]
    assert (r.status, r.detail) == ("refused", "3g.71gb is not a MIG profile of H100-80GB")
    assert host.log() == []


def test_a_mode_change_left_pending_fails_the_layout(host, tmp_path):
    # A process turns up between the check and `-mig 1`: the driver leaves the change pending.
    a = applier(tmp_path)
    a._pids = lambda devices: []  # type: ignore[method-assign]
    host.edit(0, pids=[99])
    a.advance([layout("l1")], set(), False)
    report = only_report(a)
    assert report.status == "failed" and "GPU reset is needed" in report.detail
    assert (host.gpu(0)["mig_current"], host.gpu(0)["mig_pending"]) == (0, 1)
    assert [c for c in host.log() if "-cgi" in c] == []


def test_an_agent_restarted_mid_apply_finishes_the_layout(host, tmp_path):
    a = applier(tmp_path)
    real = a._smi

    def killed_after_first_cgi(*args):
        if "-cgi" in args:
            real(*args[:3], "-cgi", "1g.10gb,2g.20gb", "-C")  # part of it was done
            raise KeyboardInterrupt("the agent was killed")
        return real(*args)

    a._smi = killed_after_first_cgi  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        a.advance([layout("l1")], set(), False)
    assert json.loads((tmp_path / "mig" / "0.json").read_text())["status"] == "applying"
    assert len(host.gpu(0)["gis"]) == 2
    host.log()

    again = applier(tmp_path)
    assert again.pending() == []
    again.advance([layout("l1")], set(), False)
    calls = host.log()
    assert calls[1:4] == [
        ["mig", "-i", "0", "-dci"],
        ["mig", "-i", "0", "-dgi"],
        ["mig", "-i", "0", "-cgi", "1g.10gb,1g.10gb,2g.20gb,3g.40gb", "-C"],
    ]
    report = only_report(again)
    assert report.status == "applied" and len(report.instances) == 4
    # Restarted again before the report was acknowledged: told again, nothing run again.
    third = applier(tmp_path)
    third.advance([layout("l1")], set(), False)
    assert host.log() == [] and only_report(third).instances == report.instances
    third.acked([(0, "l1", 1)])
    # Acknowledged and no longer asked for: forgotten.
    third.advance([], set(), False)
    assert not (tmp_path / "mig" / "0.json").exists()


def test_a_gpu_already_laid_out_runs_nothing(host, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_PLACEMENT", "highest")
    a = applier(tmp_path)
    a.advance([layout("l1", [("2g.20gb", 0), ("1g.10gb", 2)])], set(), False)
    assert only_report(a).status == "applied"
    host.log()
    # The same profiles, other starts (the driver placed them at 4 and 6): nothing to do.
    b = applier(tmp_path / "other")
    b.advance([layout("l2", [("1g.10gb", 2), ("2g.20gb", 0)])], set(), False)
    assert host.log() == [] and only_report(b).status == "applied"
    # A whole GPU asked to be whole.
    b.advance([layout("l3", [], gpu=1, mig=False)], set(), False)
    assert host.log() == [] and {r.id: r.status for r, *_ in b.pending()}["l3"] == "applied"


def test_through_the_agent_waiting_for_its_own_run(host, state_dir, monkeypatch):
    client = FakeClient()
    agent = Agent(config(state_dir), client, nvml=fake_nvml)
    agent.prepare()
    assert agent.inventory is not None and agent.inventory.capabilities == ["mig-layout", "volumes"]
    agent.set_assignments(assignments().model_copy(update={"mig_layouts": [layout("l1")]}))

    def told(lid):
        return next((r for rep in client.reports for r in rep.mig_layouts if r.id == lid), None)

    report = step_until(agent, lambda: told("l1"))
    assert report.status == "applied"
    sent = next(rep for rep in client.reports if rep.mig_layouts)
    assert sent.inventory is not None
    assert sorted(m.uuid for m in sent.inventory.gpus[0].mig_instances) == sorted(
        m.uuid for m in report.instances
    )
    mig_uuid = report.instances[0].uuid
    host.log()

    # A run on one of the new instances (the agent knows its UUID now); then GPU 0 whole again.
    run = assignment("w1", python("import time; time.sleep(60)"), devices=[mig_uuid])
    agent.set_assignments(
        assignments(run, index=2).model_copy(update={"mig_layouts": [layout("l2", [], mig=False)]})
    )
    step_until(
        agent, lambda: client.last("w1") is not None and client.last("w1").state == "running"
    )
    for _ in range(3):
        agent.step()
    assert told("l2") is None and host.log() == [], "it waits while its own run uses the GPU"
    agent.set_assignments(
        assignments(index=3).model_copy(update={"mig_layouts": [layout("l2", [], mig=False)]})
    )
    report = step_until(agent, lambda: told("l2"))
    assert (report.status, report.mig_mode) == ("applied", False)
    assert agent.inventory.gpus[0].mig_instances == [] and mig_uuid not in agent._device_ids
    agent.close()


def test_capability_only_where_layouts_can_be_applied(host, state_dir, monkeypatch):
    from tests.fixtures.agent import agent as file_agent

    assert file_agent(state_dir).inventory.capabilities == ["volumes"]  # a file inventory: no NVML
    monkeypatch.setenv("PATH", "/nonexistent")
    agent = Agent(config(state_dir / "b"), FakeClient(), nvml=fake_nvml)
    agent.prepare()
    assert agent.inventory.capabilities == ["volumes"]
    agent.close()


def test_the_geometry_tables_agree_with_placement():
    from app.placement import mig as placement

    assert agent_mig._NAMES == placement._NAMES
    assert agent_mig.SHAPES == {
        k: (p.compute, p.memory, p.starts) for k, p in placement.PROFILES.items()
    }
    for nvml_name, (_, names) in fake_smi.MODELS.items():
        model = {"NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA H100 80GB HBM3": "H100-80GB"}.get(
            nvml_name, "H200-141GB"
        )
        assert names == placement.model_profile_names(model)
        for name, (c, m, starts, _) in fake_smi.shapes(nvml_name).items():
            p = placement.profile_by_name(model, name)
            assert (c, m, starts) == (p.compute, p.memory, p.starts)
    # Every set of up to 7 placements: valid for one exactly when valid for the other.
    placements = [(k, s) for k, p in placement.PROFILES.items() for s in p.starts]
    checked = valid = 0
    for n in range(1, 8):
        for combo in itertools.combinations(placements, n):
            got = agent_mig.valid_layout(list(combo))
            assert got == placement.valid_layout(list(combo)), combo
            checked += 1
            valid += got
    assert checked > 30_000 and valid > 100
