"""What the agent tells the control plane about its runs: each run's report in POST /status,
and batches of their new output for POST /logs.

The reporter thread sends both (`Agent.report`, `Agent.ship_logs`); here is only what they
send. A batch reads each run's output from the offset the control plane last took, at most
LOG_BATCH_BYTES in all; the offsets advance only once the batch is taken, so output refused
or lost on the way is offered again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, NamedTuple, cast

from rackplane_agent import logs as logs_mod
from rackplane_agent.client import ApiError, Backoff, TransientError
from rackplane_agent.logfmt import kv
from rackplane_agent.state import EXITED, FAILED_TO_START, LOST, RUNNING, RunRecord
from rackplane_wire import LogChunk, RunReport, RunState

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")

LOG_BATCH_BYTES = 512 * 1024


def fault(rec: RunRecord) -> Literal["workload", "agent"] | None:
    """Whose fault a run's end is, where it is not the host's: the workload's own start
    failure, or this agent's failure to record a lost run's exit."""
    if rec.state == FAILED_TO_START and rec.fault == "workload":
        return "workload"
    if rec.state == LOST and rec.fault == "agent":
        return "agent"
    return None


def run_report(rec: RunRecord, clock: Callable[[], float]) -> RunReport:
    """The run as POST /status tells it: its state since when, its end, its endpoints."""
    if rec.state == RUNNING:
        at = rec.started_at
    else:
        at = rec.ended_at
    at_dt = datetime.fromtimestamp(at if at is not None else clock()).astimezone()
    tail = logs_mod.tail(rec.output) if rec.state in (EXITED, LOST) else []
    return RunReport(
        workload_id=rec.workload_id,
        attempt=rec.attempt,
        replica=rec.replica,
        state=cast(RunState, rec.state),
        at=at_dt,
        pid=rec.pid,
        exit_code=rec.exit_code if rec.state == EXITED else None,
        signal=rec.signal if rec.state == EXITED else None,
        stopped=rec.stopped and rec.state != FAILED_TO_START,
        message=rec.message,
        fault=fault(rec),
        # The endpoint while it runs (the port is free again once it has ended).
        ssh_port=rec.ssh_port if rec.state == RUNNING else None,
        ssh_ready=rec.ssh_ready and rec.state == RUNNING,
        serve_port=rec.serve_port if rec.state == RUNNING else None,
        serve_ready=rec.serve_ready and rec.state == RUNNING,
        tail=tail,
    )


class LogSource(NamedTuple):
    """What a batch reads of one run, copied under the agent's lock."""

    key: str
    workload_id: str
    attempt: int
    replica: int
    output: Path
    offset: int  # where the output the control plane has not taken yet starts
    state: str


def log_sources(runs: Iterable[RunRecord]) -> list[LogSource]:
    """Each run's output and how far it is shipped."""
    return [
        LogSource(r.key, r.workload_id, r.attempt, r.replica, r.output, r.log_offset, r.state)
        for r in runs
    ]


@dataclass
class OutputBatch:
    """New output of the runs, as one POST /logs carries it."""

    chunks: list[LogChunk]
    ends: dict[str, int]  # run -> the offset its output is shipped to once the batch is taken
    budget_left: int  # bytes the batch could still have carried (0 or less: it is full)
    more: bool  # runs were left out: the batch was full before it reached them


def output_batch(sources: Iterable[LogSource], budget: int, at: datetime) -> OutputBatch:
    """New output of each run in turn, from its offset, `budget` bytes and 400 chunks at most
    in all (a finished run's output to its very end)."""
    chunks: list[LogChunk] = []
    ends: dict[str, int] = {}
    more = False
    for key, wid, attempt, replica, path, offset, state in sources:
        if budget <= 0 or len(chunks) >= 400:
            more = True
            break
        pieces = logs_mod.read_chunks(path, offset, final=state != RUNNING, max_bytes=budget)
        for start, data in pieces:
            chunks.append(
                LogChunk(
                    workload_id=wid,
                    attempt=attempt,
                    replica=replica,
                    offset=start,
                    data=logs_mod.decode(data),
                    at=at,
                )
            )
            ends[key] = start + len(data)
            budget -= len(data)
    return OutputBatch(chunks, ends, budget, more)


def logs_retry(
    exc: TransientError | ApiError,
    backoff: Backoff,
    budget: int,
    *,
    refused_delay: float,
    chunks: int,
) -> tuple[float, int]:
    """After a POST /logs that failed: how long until output is offered again, and the
    bytes a batch may carry then (a 413 halves them, down to one chunk)."""
    if isinstance(exc, TransientError):
        delay = backoff.next(exc)
        log.warning(kv("logs_failed", error=exc, retry_in_s=round(delay, 2)))
        return delay, budget
    # Offsets advance only on a 2xx: the same output is offered again, later (a 413: in
    # smaller batches).
    if exc.status == 413 and budget > logs_mod.CHUNK_BYTES:
        budget = max(logs_mod.CHUNK_BYTES, budget // 2)
        delay = 0.0
    else:
        delay = refused_delay
    log.error(kv("logs_refused", error=exc, chunks=chunks, retry_in_s=delay))
    return delay, budget
