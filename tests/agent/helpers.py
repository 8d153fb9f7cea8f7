"""Builders for the agent's tests: an inventory, assignments, a config, a fake client."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from rackplane_agent.client import ApiError
from rackplane_agent.config import AgentConfig
from rackplane_agent.runner import Agent
from rackplane_wire import (
    Assignment,
    Assignments,
    GpuInfo,
    Inventory,
    LogAck,
    LogBatch,
    MigInstance,
    RunEnv,
    StatusAck,
    StatusReport,
)

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
PY = sys.executable
# What a run with a uid of its own runs Python with: the test's own interpreter may lie under a
# directory other users cannot enter (/root, a 0700 virtual environment).
SYSTEM_PY = "/usr/bin/python3"
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
MIG0 = "MIG-00000000-0000-0000-0000-0000000000aa"

INVENTORY = Inventory(
    hostname="node-1",
    address="10.0.0.1",
    source="file",
    gpus=[
        GpuInfo(
            index=0,
            uuid=GPU0,
            model="H100-80GB",
            memory_mib=81559,
            mig_mode=True,
            mig_instances=[MigInstance(uuid=MIG0, profile="1g.10gb", start=0)],
        ),
        GpuInfo(index=1, uuid=GPU1, model="H100-80GB", memory_mib=81559),
    ],
    runtimes=["process"],
    agent_version="0.1.0",
)


def config(state_dir: Path, **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = dict(
        api="http://control-plane.test",
        state_dir=state_dir,
        runtimes=["process"],
        poll_wait=1.0,
        reconcile_interval=0.05,
        log_interval=0.1,
        heartbeat_s=5.0,
        checkpoint_min_age_s=0.0,
        backoff_initial=0.05,
        backoff_max=0.2,
        request_timeout=3.0,
        cgroups=False,
        # Runs as this test's user: the wall between runs has tests of its own (test_wall.py).
        run_uids=None,
    )
    values.update(overrides)
    return AgentConfig(**values)


def assignment(workload_id: str, command: list[str], **kw: Any) -> Assignment:
    values: dict[str, Any] = dict(
        workload_id=workload_id,
        attempt=0,
        replica=0,
        desired="run",
        command=command,
        env={"RACKPLANE_WORKLOAD_ID": workload_id},
        devices=[],
        grace_s=5.0,
    )
    values.update(kw)
    return Assignment(**values)


def assignments(*items: Assignment, index: int = 1, heartbeat_s: float = 5.0) -> Assignments:
    return Assignments(node="node-1", index=index, assignments=list(items), heartbeat_s=heartbeat_s)


def python(code: str) -> list[str]:
    return [PY, "-c", code]


class FakeClient:
    """Stands in for `Client` in step() tests: keeps what the agent sends."""

    def __init__(self) -> None:
        self.credential = "rpn_test"
        self.reports: list[StatusReport] = []
        self.batches: list[LogBatch] = []
        self.fail_status: list[Exception] = []
        self.fail_logs: list[Exception] = []
        # The secret env the control plane gives each workload's run as it starts.
        self.secret_env: dict[str, dict[str, str]] = {}
        self.env_refusals: dict[str, str] = {}  # workload -> why its runs cannot start
        self.env_fetches: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def run_env(self, workload_id: str, attempt: int, replica: int, **_: Any) -> RunEnv:
        with self.lock:
            self.env_fetches.append((workload_id, attempt, replica))
            if workload_id in self.env_refusals:
                raise ApiError(409, "run_refused", self.env_refusals[workload_id], "/runs")
            if workload_id not in self.secret_env:
                raise ApiError(409, "run_not_startable", "not held", "/runs")
            return RunEnv(env=self.secret_env[workload_id])

    def status(self, report: StatusReport, **_: Any) -> StatusAck:
        with self.lock:
            if self.fail_status:
                raise self.fail_status.pop(0)
            self.reports.append(report)
        return StatusAck(accepted=len(report.runs), stale=0)

    def logs(self, batch: LogBatch, **_: Any) -> LogAck:
        with self.lock:
            if self.fail_logs:
                raise self.fail_logs.pop(0)
            self.batches.append(batch)
        return LogAck(accepted=len(batch.chunks), stale=0)

    def close(self) -> None:
        pass

    def last(self, workload_id: str):
        """The last report about a workload's run, or None."""
        for report in reversed(self.reports):
            for run in report.runs:
                if run.workload_id == workload_id:
                    return run
        return None

    def output(self, workload_id: str) -> str:
        chunks = [c for b in self.batches for c in b.chunks if c.workload_id == workload_id]
        return "".join(c.data for c in sorted(chunks, key=lambda c: c.offset))


def agent(state_dir: Path, client: Any | None = None, **overrides: Any) -> Agent:
    a = Agent(config(state_dir, **overrides), client or FakeClient(), inventory=INVENTORY)
    a.prepare()
    return a


def step_until(agent_: Agent, predicate, timeout: float = 10.0, interval: float = 0.05):
    """step() the agent until predicate() holds."""
    deadline = time.monotonic() + timeout
    while True:
        agent_.step()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def open_dir(prefix: str = "rp-test-") -> Path:
    """A directory every uid can traverse (not list): where runs with their own uid work.
    pytest's tmp_path lies under a 0700 directory that such a run could not enter."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o711)
    return path


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
