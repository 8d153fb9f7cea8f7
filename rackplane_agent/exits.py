"""A run's end, once its process is gone: how it ended, and when its record may go.

How it ended is read, in order of trust, from the exit record its shim wrote, from the kill
the agent sent, from its shim's own return code; else it is `lost`. A run found gone as the
agent starts (it was down, or the host lost power) ends when the earlier agent last saw it
alive: while runs live, the agent writes that down every ALIVE_MARK_S (`mark_alive`). A run is
forgotten (its directory removed) only once the control plane has acknowledged its end, no
assignment names it and its output is shipped.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from rackplane_agent.logfmt import kv
from rackplane_agent.shim import signal_name
from rackplane_agent.state import EXITED, LOST, RUNNING, RunRecord, StateDir

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")

# How often, at most, the agent writes down that it saw its runs alive (StateDir.mark_alive):
# what a run found gone after a power cut is billed to, at worst this much short.
ALIVE_MARK_S = 1.0


def parse_iso(value: Any) -> float | None:
    """An exit record's ISO 8601 time -> epoch seconds; None when it is none."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def mark_alive(state: StateDir, now: float, marked: float) -> float:
    """Write down that the runs were alive at `now`, unless done less than ALIVE_MARK_S ago
    (`marked`, monotonic); when it was last done."""
    # Paced on the monotonic clock: a wall clock stepped back must not stop the marks.
    tick = time.monotonic()
    if tick - marked < ALIVE_MARK_S:
        return marked
    try:
        state.mark_alive(now)
    except OSError as exc:  # a full or read-only disk: the runs go on regardless
        log.warning(kv("alive_mark_failed", error=exc))
    return tick


def record_end(
    rec: RunRecord,
    exit_record: dict[str, Any] | None,
    returncode: int | None,
    now: float,
    while_down: bool = False,
    seen_alive: float | None = None,
) -> None:
    """Set how and when the run ended from its exit record, the kill sent, or its shim's
    `returncode` (None: unknown); `while_down`: found gone as the agent started."""
    if exit_record is not None:
        rec.state = EXITED
        code = exit_record.get("exit_code")
        rec.exit_code = code if isinstance(code, int) and -255 <= code <= 255 else None
        sig = exit_record.get("signal")
        rec.signal = str(sig)[:16] if sig else None
        rec.ended_at = parse_iso(exit_record.get("at")) or now
    elif rec.kill_sent_at is not None:
        rec.state, rec.signal, rec.stopped = EXITED, "SIGKILL", True
        rec.ended_at = now
    elif returncode is not None and returncode < 0:
        rec.state = EXITED
        rec.signal = signal_name(-returncode)
        rec.ended_at = now
        rec.message = "the run's shim was killed"
    elif returncode is not None:
        # Its shim ended as it does after its process, yet no exit record is there: this
        # agent failed to keep it (it could not be written or read), not the workload.
        rec.state, rec.fault = LOST, "agent"
        rec.ended_at = now
        rec.message = (
            f"the run's shim ended (code {returncode}) but its exit record could not be "
            "read: the agent's failure"
        )
    else:
        rec.state = LOST
        rec.ended_at = now
        rec.message = "the run's process is gone and left no exit record"
        if while_down and seen_alive is not None:
            # It ran at least until the earlier agent last saw it; nothing says longer.
            rec.ended_at = min(now, max(seen_alive, rec.started_at or seen_alive))
            at = datetime.fromtimestamp(rec.ended_at).astimezone()
            rec.message += f"; last seen running at {at:%Y-%m-%d %H:%M:%S %z}"
    log.info(
        kv(
            "run_ended",
            run=rec.key,
            state=rec.state,
            exit_code=rec.exit_code,
            signal=rec.signal,
            stopped=rec.stopped,
            while_agent_down=while_down or None,
        )
    )


def forgettable(rec: RunRecord, logs_enabled: bool) -> bool:
    """Whether an ended run's directory may go (no assignment naming it): the control plane
    acknowledged its end, and its output is shipped (when the agent ships output at all)."""
    if rec.state == RUNNING or rec.acked_version < rec.version:
        return False
    if logs_enabled:
        try:
            size = rec.output.stat().st_size
        except OSError:
            size = 0
        if rec.log_offset < size:
            return False
    return True
