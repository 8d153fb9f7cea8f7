"""Burn-in on the agent: stand-in validation commands that pass, fail naming a GPU, hang (a
timeout) and under-perform (bus bandwidth below the bound), run as real processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from rackplane_agent.burnin import BurnInRunner, judge
from rackplane_wire import BurnIn, BurnInStep

pytestmark = pytest.mark.no_db

PY = sys.executable


def step(name: str, code: str, *, timeout: float = 20, bound: float | None = None) -> BurnInStep:
    return BurnInStep(name=name, command=[PY, "-c", code], timeout_s=timeout, min_busbw_gbps=bound)


PASS = step("dcgm-diag", "print('| Memory  | Pass |')")
NCCL_OK = step("nccl", "print('#  Avg bus bandwidth    : 371.2')", bound=300)
NCCL_SLOW = step("nccl", "print('#  Avg bus bandwidth    : 120.5')", bound=300)
DCGM_FAIL = step(
    "dcgm-diag", "print('| Memory  | Fail - GPU: 3  ECC errors |'); raise SystemExit(226)"
)
HANG = step("hang", "import time; time.sleep(60)", timeout=0.5)


def drive(runner: BurnInRunner, desired: BurnIn | None, *, busy=False, until=20.0) -> None:
    """Advance until the burn-in is over (or `until` seconds)."""
    end = time.monotonic() + until
    while time.monotonic() < end:
        runner.advance(desired, busy, time.time())
        if runner.state is None or runner.state.done:
            return
        time.sleep(0.05)


def test_judging_what_steps_print():
    ok = judge(NCCL_OK, 0, "#  Avg bus bandwidth    : 371.2\n", 1.0)
    assert (ok.status, ok.busbw_gbps, ok.gpu) == ("passed", 371.2, None)
    slow = judge(NCCL_SLOW, 0, "#  Avg bus bandwidth    : 120.5\n", 1.0)
    assert slow.status == "failed" and "below the bound 300" in slow.detail
    silent = judge(NCCL_OK, 0, "all good\n", 1.0)
    assert silent.status == "failed" and "no bus bandwidth" in silent.detail
    dcgm = judge(PASS, 0, "| PCIe | Pass |\n| Memory | Fail - GPU: 5 ECC |\n", 2.0)
    assert (dcgm.status, dcgm.gpu) == ("failed", 5)
    line = judge(PASS, 0, 'RACKPLANE-BURNIN status=fail gpu=2 detail="HBM row remap"\n', 1)
    assert (line.status, line.gpu, line.detail) == ("failed", 2, "HBM row remap")
    crashed = judge(PASS, 139, "segfault in kernel\n", 1)
    assert crashed.status == "failed" and "exited with 139: segfault in kernel" in crashed.detail


def test_a_suite_that_passes_is_reported_once_acknowledged(tmp_path: Path):
    runner = BurnInRunner(tmp_path / "burn-in", ["GPU-a", "GPU-b"])
    desired = BurnIn(id="b1", steps=[PASS, NCCL_OK])
    drive(runner, desired, busy=True, until=0.3)
    assert runner.state is not None and runner.state.results == [], "it waits for idle"
    drive(runner, desired)
    pending = runner.pending()
    assert pending is not None
    report, version = pending
    assert report.done and [r.status for r in report.results] == ["passed", "passed"]
    assert report.results[1].busbw_gbps == 371.2
    runner.acked(version)
    assert runner.pending() is None
    # A new agent over the same state directory remembers it.
    again = BurnInRunner(tmp_path / "burn-in", ["GPU-a", "GPU-b"])
    assert again.state is not None and again.state.done and again.pending() is None


def test_failures_stop_the_suite_and_name_the_step_and_gpu(tmp_path: Path):
    for i, (steps, expect) in enumerate(
        (
            ([DCGM_FAIL, NCCL_OK], ("dcgm-diag", "failed", 3)),
            ([PASS, NCCL_SLOW], ("nccl", "failed", None)),
            ([HANG, PASS], ("hang", "timed_out", None)),
        )
    ):
        runner = BurnInRunner(tmp_path / str(i), ["GPU-a"])
        drive(runner, BurnIn(id="b", steps=steps))
        report, _ = runner.pending() or (None, 0)
        assert report is not None and report.done
        last = report.results[-1]
        assert (last.name, last.status, last.gpu) == expect, report
        assert len(report.results) == steps.index(next(s for s in steps if s.name == expect[0])) + 1


def test_a_withdrawn_or_restarted_burn_in_leaves_no_process(tmp_path: Path):
    long = step("soak", "import time; time.sleep(60)", timeout=60)
    runner = BurnInRunner(tmp_path / "burn-in", ["GPU-a"])
    runner.advance(BurnIn(id="b2", steps=[long]), False, time.time())
    pid = runner.state.pid
    assert pid and psutil.pid_exists(pid)
    # The agent restarts: the step's process is killed, and the step will run again.
    restarted = BurnInRunner(tmp_path / "burn-in", ["GPU-a"])
    assert restarted.state.pid is None and restarted.state.results == []
    time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    restarted.advance(BurnIn(id="b2", steps=[long]), False, time.time())
    pid2 = restarted.state.pid
    assert pid2 and pid2 != pid
    # The control plane no longer asks for it: stopped and forgotten.
    restarted.advance(None, False, time.time())
    time.sleep(0.2)
    assert not psutil.pid_exists(pid2) or psutil.Process(pid2).status() == psutil.STATUS_ZOMBIE
