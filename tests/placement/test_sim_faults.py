"""`rackplane sim faults`: the goodput replay's accounting, its policies and the health logic it
drives (rackplane_bench/sim/faults.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from app.health import actions
from rackplane_bench.sim import faults as F

pytestmark = pytest.mark.no_db

CAUSES = {c.name: c for c in F.LLAMA3}
# A small fleet, no background work: every figure below follows from the parameters.
P = F.Params(gpus=256, days=2, background_load=0.0, hot_spares=2, spare_share=0.1)


def one(cause: str, at: float = 1000.0, node: int = 3, back: bool = True, warned=False):
    return F.Fault(at, node, 0, CAUSES[cause], back, warned)


def run(policy: str, faults: list[F.Fault], p: F.Params = P) -> F.Result:
    return F.replay(p, policy, faults, [])


def test_no_faults_no_loss_but_checkpoints():
    r = run("requeue", [])
    horizon = P.days * F.DAY
    period = P.checkpoint_every_s + P.checkpoint_cost_s
    assert r.interruptions == 0 and not r.mttr
    # The horizon ends mid-interval: whole checkpoints only, the rest is progress.
    writes = math.floor(horizon / period) * P.checkpoint_cost_s
    assert r.parts["checkpointing"] == pytest.approx(writes)
    assert r.progress_s == pytest.approx(horizon - writes)


@pytest.mark.parametrize(
    ("policy", "mttr"),
    [
        # Telemetry shows the Xid 79, the node reboots out of the job; a cold node joins.
        ("requeue", P.detect_s + P.provision_s + P.restart_s),
        # A warm spare takes its place: no provisioning.
        ("default", P.detect_s + P.restart_s),
        # Nobody acts until a human does, then as requeue.
        ("manual", P.human_s + P.detect_s + P.provision_s + P.restart_s),
    ],
)
def test_one_gpu_off_the_bus(policy, mttr):
    r = run(policy, [one("faulty_gpu")])
    assert r.interruptions == 1
    assert r.mttr == [pytest.approx(mttr)]
    # Nothing was saved before the first checkpoint (1,800 s): the 1,000 s are recomputed.
    assert r.parts["recomputation"] == pytest.approx(1000.0)
    assert r.parts["detection"] == pytest.approx(mttr - r.parts["restart"])
    # The node went quarantined -> draining -> repairing -> validating -> healthy.
    assert r.transitions == 5
    assert sum(r.parts.values()) == pytest.approx(P.days * F.DAY)


def test_an_application_error_restarts_in_place():
    """Xid 13 leaves the GPU in service (the action table): nothing to replace, no repair."""
    assert actions.rule_for_xid(13).action is actions.Action.none
    r = run("requeue", [one("software_bug")])
    assert r.mttr == [pytest.approx(P.restart_s)] and r.transitions == 0


def test_a_hang_waits_for_the_watchdog_unless_step_telemetry_sees_it():
    slow = run("requeue", [one("network_switch_cable")])
    fast = run("default", [one("network_switch_cable")])
    assert slow.parts["detection"] == pytest.approx(P.hang_timeout_s)
    assert fast.parts["detection"] == pytest.approx(P.stall_detect_s)
    # Out of service for 48 h (past these two days), back through an operator after them.
    assert slow.transitions == 2
    assert run("requeue", [one("network_switch_cable")], replace(P, days=3)).transitions == 4


def test_faults_off_the_job_touch_only_what_runs_there():
    spare_node = P.gpus // F.GPUS_PER_NODE - 1  # the spare pool is the last nodes
    r = run("requeue", [one("faulty_gpu", node=spare_node)])
    assert r.interruptions == 0 and r.parts.get("recomputation", 0.0) == 0.0
    assert r.transitions == 5


def test_a_second_fault_during_recovery_is_one_longer_outage():
    r = run("requeue", [one("faulty_gpu"), one("gpu_hbm3", at=1100.0, node=5)])
    assert r.interruptions == 1 and len(r.mttr) == 1
    assert r.mttr[0] == pytest.approx(100 + P.detect_s + P.provision_s + P.restart_s)
    assert sum(r.parts.values()) == pytest.approx(P.days * F.DAY)


def test_default_moves_off_a_suspect_gpu_at_the_checkpoint_before_the_fault():
    f = one("gpu_hbm3", at=20 * 3600.0, warned=True)
    d = run("default", [f])
    q = run("requeue", [f])
    assert d.avoided == 1 and d.interruptions == 0 and d.parts.get("recomputation", 0) == 0
    assert q.avoided == 0 and q.interruptions == 1
    assert d.progress_s > q.progress_s


def test_young_daly_matches_dalys_figures():
    # Daly (2006), restart 10 min and checkpoint 5 min: M = 24 h -> 117 min, 6 h -> 57 min,
    # 15 min -> 9.1 min.
    for mtbf_min, tau_min in ((24 * 60, 117), (6 * 60, 57), (15, 9.1)):
        assert F.young_daly(5 * 60, mtbf_min * 60) / 60 == pytest.approx(tau_min, abs=0.6)
    assert F.young_daly(100, 40) == 40  # a checkpoint costlier than the failures come


def test_faults_are_seeded_and_shared_by_the_policies():
    p = replace(P, gpus=2048, days=10, faults_per_gpu_day=10 * P.faults_per_gpu_day)
    a, b = F.draw_faults(p), F.draw_faults(p)
    assert [(f.at, f.node, f.cause.name) for f in a] == [(f.at, f.node, f.cause.name) for f in b]
    assert F.draw_faults(replace(p, seed=2)) != a
    # Llama 3's rate: about 419 over 54 days on 16,384 GPUs.
    assert 340 < len(F.draw_faults(F.Params())) < 500
    results = {pol: run(pol, a, p) for pol in F.POLICIES}
    for r in results.values():
        assert sum(r.parts.values()) == pytest.approx(p.days * F.DAY)
        assert r.faults == len(a)
    ett = {k: v.as_dict()["effective_training_time"] for k, v in results.items()}
    assert ett["manual"] < ett["requeue"] < ett["default"]
    # The replay is a function of its input.
    assert run("default", a, p).as_dict() | {"seconds": 0} == results["default"].as_dict() | {
        "seconds": 0
    }


def test_background_work_runs_beside_the_job_and_loses_work_to_faults(tmp_path):
    trace = tmp_path / "jobs.csv"
    rows = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for i in range(40):
        rows.append(f"2017-10-09 07:{i:02d}:00,{3600 + 60 * i},{1 + i % 8},0,t{i % 3}")
    trace.write_text("\n".join(rows) + "\n")
    p = replace(P, background_load=5.0, days=1)
    bg = F.background_jobs(p, trace)
    assert bg and all(j.gpus <= 8 for j in bg)
    spare = p.gpus // F.GPUS_PER_NODE - 1
    r = F.replay(p, "requeue", [one("faulty_gpu", at=5000.0, node=spare)], bg)
    assert r.bg_finished == len(bg) and r.bg_jct
    d = F.replay(p, "default", [], bg)
    # Hot spares take part of the pool: background work waits longer, never forever.
    assert d.bg_finished == len(bg)


def test_cli_json_and_errors():
    runner = CliRunner()
    from app.cli import cli

    out = runner.invoke(
        cli,
        ["sim", "faults", "--gpus", "512", "--days", "3", "--background-load", "0", "--json"],
    )
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    by = {r.get("policy"): r for r in rows if "policy" in r}
    assert set(by) == set(F.POLICIES)
    for r in by.values():
        assert {"effective_training_time", "goodput_gpu_hours", "mttr_s"} <= set(r)
        assert set(r["lost_gpu_hours"]) == {
            "detection",
            "restart",
            "recomputation",
            "waiting_for_capacity",
        }
    assert by["default"]["params"]["checkpoint_cost_s"] == 2.0
    assert rows[-1]["summary"] == "sim faults"
    bad = runner.invoke(cli, ["sim", "faults", "--policy", "luck"])
    assert bad.exit_code == 2
