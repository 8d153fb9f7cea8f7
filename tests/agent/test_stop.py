"""`rackplane agent stop` (issue 45 item 9): the README's `pkill -f 'rackplane_agent --api'`
and `pkill -f examples/train.py` killed every user's agents and jobs on a shared host. `stop`
reaches the agent of one state directory through its lock (its pid file), and with
`--power-cut` that directory's runs: never a look-alike process of someone else."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from rackplane_agent import stop
from rackplane_agent.state import RunRecord, StateDir

pytestmark = pytest.mark.no_db

HOLD = """
import sys, time
from pathlib import Path
from rackplane_agent.state import StateDir
s = StateDir(Path(sys.argv[1])); s.ensure(); s.lock()
print("locked", flush=True)
time.sleep(600)
"""


def _agent_like(state_dir) -> subprocess.Popen:
    """A process holding the state directory's lock, as a running agent does."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "locked"
    return p


def _group(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(list(argv), start_new_session=True)


def _record(state: StateDir, wid: str, proc: subprocess.Popen) -> None:
    rec = RunRecord(workload_id=wid, attempt=1, replica=0, assignment={}, pid=proc.pid)
    rec.create_time = psutil.Process(proc.pid).create_time()
    rec.run_dir = state.run_dir(wid, 1, 0)
    rec.run_dir.mkdir(parents=True)
    rec.save()


def test_stop_reaches_one_agent_and_a_power_cut_its_runs_alone(tmp_path, capsys):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    assert stop.main(["--state-dir", str(mine)]) == stop.EXIT_NOT_RUNNING
    assert "no agent runs on" in capsys.readouterr().out

    # Two agents, each with a run of the very same command line.
    a, b = _agent_like(mine), _agent_like(theirs)
    state = StateDir(mine)
    run_a = _group("sleep", "600")
    run_b = _group("sleep", "600")
    _record(state, "w-mine", run_a)
    _record(StateDir(theirs), "w-theirs", run_b)
    try:
        # A plain stop: SIGTERM to this agent; its run keeps running.
        assert stop.main(["--state-dir", str(mine)]) == stop.EXIT_STOPPED
        assert a.wait(timeout=10) == -15
        assert run_a.poll() is None and b.poll() is None

        # A power cut: the agent and its runs, nothing of the other directory's.
        a = _agent_like(mine)
        assert stop.main(["--state-dir", str(mine), "--power-cut"]) == stop.EXIT_STOPPED
        assert a.wait(timeout=10) == -9
        assert run_a.wait(timeout=10) == -9
        time.sleep(0.2)
        assert b.poll() is None and run_b.poll() is None
        assert "killed 1 run(s): w-mine.1.0" in capsys.readouterr().out
    finally:
        for p in (a, b, run_a, run_b):
            p.kill()
            p.wait()


def test_a_run_without_its_start_time_is_left_and_a_foreign_directory_is_refused(
    tmp_path, capsys, monkeypatch
):
    state = StateDir(tmp_path / "mine")
    unproven = _group("sleep", "600")
    rec = RunRecord(workload_id="w-old", attempt=1, replica=0, assignment={}, pid=unproven.pid)
    rec.run_dir = state.run_dir("w-old", 1, 0)
    rec.run_dir.mkdir(parents=True)
    rec.save()  # no create_time: nothing proves that pid is still this run's
    try:
        assert stop.main(["--state-dir", str(state.root), "--power-cut"]) == stop.EXIT_NOT_RUNNING
        assert "killed 0 run(s)" in capsys.readouterr().out
        assert unproven.poll() is None
    finally:
        unproven.kill()
        unproven.wait()

    def denied(_lock):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(stop, "_holder", denied)
    assert stop.main(["--state-dir", str(state.root)]) == stop.EXIT_DENIED
    assert "is not yours to read" in capsys.readouterr().out
