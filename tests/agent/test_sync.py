"""The whole agent against an in-process control plane: join, inventory, the long poll, runs,
reports with a 503 and its backoff, logs, telemetry, forgetting, and a revoked credential."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rackplane_agent.runner import Agent
from tests.agent.fakecp import FakeControlPlane
from tests.fixtures.agent import GPU0, PY, ROOT, TRAIN, assignment, config, python, wait_until

pytestmark = pytest.mark.no_db

SLEEPER = python("import time; print('up', flush=True); time.sleep(60)")


@pytest.fixture
def cp():
    server = FakeControlPlane().start()
    yield server
    server.stop()


def _run_in_thread(agent: Agent) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(agent.run()), daemon=True)
    t.start()
    return t, result


def test_the_sync_loop_end_to_end(cp, state_dir, tmp_path):
    from tests.fixtures.agent import INVENTORY

    cp.status_failures = [(503, {"Retry-After": "0.3"})]
    agent = Agent(
        config(
            state_dir,
            api=cp.url,
            token="rpj_good",
            backoff_max=1.0,
            dcgm_exporter=f"{cp.url}/metrics",
            telemetry_interval=0.1,
        ),
        inventory=INVENTORY,
    )
    thread, result = _run_in_thread(agent)

    # Joined: the credential is kept, readable by the agent only.
    cred = state_dir / "credential"
    wait_until(lambda: cred.exists())
    assert stat.S_IMODE(cred.stat().st_mode) == 0o600
    assert cred.read_text().strip() in cp.credentials
    assert '"node_name": "node-1"' in (state_dir / "node.json").read_text()
    wait_until(lambda: cp.inventories)
    assert cp.inventories[0].gpus[0].uuid == GPU0

    # A run: started, its output shipped, its exit reported (after a 503 and the backoff).
    ckpt = tmp_path / "ckpt"
    train = assignment(
        "train",
        [
            PY,
            str(TRAIN),
            "--steps",
            "5",
            "--step-seconds",
            "0.02",
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            str(ckpt),
        ],
        devices=[GPU0],
        env={
            "RACKPLANE_WORKLOAD_ID": "train",
            "CUDA_VISIBLE_DEVICES": GPU0,
            "RANK": "0",
            "WORLD_SIZE": "1",
        },
    )
    cp.set_assignments([train])
    wait_until(lambda: (r := cp.last_run("train")) and r.state == "exited")
    run = cp.last_run("train")
    assert run.exit_code == 0 and not run.stopped and "step 5/5" in run.tail[-1]
    wait_until(lambda: "step 5/5" in cp.output("train"))
    assert f"step 1/5 rank=0 world=1 devices={GPU0}" in cp.output("train")
    assert sorted(p.name for p in (ckpt / "train").iterdir()) == ["step-2.json", "step-4.json"]
    first, second = cp.status_answers[0], cp.status_answers[1]
    assert first[1] == 503 and second[1] == 200 and second[0] - first[0] >= 0.29

    # dcgm-exporter's text, forwarded as it is; a 404 stops it.
    wait_until(lambda: cp.telemetry)
    assert cp.telemetry[0] == ("text/plain; version=0.0.4", cp.exporter_text)
    cp.telemetry_route = False
    time.sleep(0.4)
    count = len(cp.telemetry)
    time.sleep(0.3)
    assert len(cp.telemetry) == count

    # Heartbeats, empty or not, at least every heartbeat_s.
    times = [t for t, _ in cp.reports]
    time.sleep(1.2)
    times = [t for t, _ in cp.reports if t > times[-1]]
    assert len(times) >= 2

    # The next run; the one before, acknowledged and named no more, is forgotten.
    cp.set_assignments([assignment("sleeper", SLEEPER)])
    wait_until(lambda: (r := cp.last_run("sleeper")) and r.state == "running")
    pid = cp.last_run("sleeper").pid
    wait_until(lambda: not (state_dir / "runs" / "train.0.0").exists())
    assert [p.name for p in (state_dir / "runs").iterdir()] == ["sleeper.0.0"]

    # Revoked: the agent stops (3); the run goes on.
    cp.revoke()
    thread.join(10)
    assert result == [3]
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    os.killpg(pid, signal.SIGKILL)


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rackplane_agent", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_cannot_start_without_a_token_or_an_inventory(tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"gpus: [{{index: 0, uuid: {GPU0}, model: H100-80GB}}]\n")
    p = _cli(
        "--api",
        "http://127.0.0.1:9",
        "--state-dir",
        str(tmp_path / "s"),
        "--same-user",
        "--inventory",
        str(inventory),
        env={"RACKPLANE_JOIN_TOKEN": ""},
    )
    _, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "--token" in err and "RACKPLANE_JOIN_TOKEN" in err
    p = _cli(
        "--api", "http://127.0.0.1:9", "--state-dir", str(tmp_path / "s"), "--same-user",
        "--token", "rpj_x",
    )  # fmt: skip
    _, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "--inventory" in err
    if os.geteuid() == 0:  # a uid per run: its directory must be reachable by that uid
        p = _cli("--api", "http://127.0.0.1:9", "--state-dir", str(tmp_path / "s"), "--token", "x")
        _, err = p.communicate(timeout=20)
        assert p.returncode == 2 and "not searchable by other users" in err, err


def test_cli_restart_adopts_then_a_revoked_credential_exits_3(cp, state_dir, tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"gpus: [{{index: 0, uuid: {GPU0}, model: H100-80GB}}]\n")
    args = [
        "--api",
        cp.url,
        "--state-dir",
        str(state_dir),
        "--same-user",
        "--inventory",
        str(inventory),
        "--poll-wait",
        "1",
        "--runtime",
        "process",
    ]
    cp.set_assignments([assignment("sleeper", SLEEPER)])

    agent = _cli(*args, env={"RACKPLANE_JOIN_TOKEN": "rpj_good"})
    again = None
    try:
        wait_until(lambda: (r := cp.last_run("sleeper")) and r.state == "running", timeout=15)
        pid = cp.last_run("sleeper").pid
        agent.send_signal(signal.SIGTERM)  # the agent stops; its run does not
        _, err = agent.communicate(timeout=10)
        assert agent.returncode == 0, err
        assert psutil.Process(pid).is_running()
        assert cp.inventories[0].hostname and cp.inventories[0].source == "file"

        cp.reports.clear()
        again = _cli(*args)  # no token needed now: the credential is in the state directory
        wait_until(lambda: cp.last_run("sleeper"), timeout=15)
        assert cp.last_run("sleeper").pid == pid  # adopted, not started again
        cp.revoke()
        _, err = again.communicate(timeout=15)
        assert again.returncode == 3, err
        assert "credential_revoked" in err and "run_adopted" in err
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    finally:  # whatever failed, no agent outlives the test
        for p in (agent, again):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    os.killpg(pid, signal.SIGKILL)
