"""The signals the agent sends a running run: SIGTERM to stop it, SIGKILL once its grace is
over, and the workload's own checkpoint signal when the control plane asks for one.

A stop starts when the control plane asks for it or stops naming the run; the run then has its
grace (cut short by the control plane's deadline, if any) before the kill. A checkpoint
request is sent once, and only after the run has been up `checkpoint_min_age_s` (its handlers
may not be installed before). Every signal goes through the run's runtime (`Runtime.signal`):
its shim's process group, and what a container or a VM needs besides.
"""

from __future__ import annotations

import logging
import signal

from rackplane_agent import runtimes
from rackplane_agent.logfmt import kv
from rackplane_agent.runusers import RunUsers
from rackplane_agent.state import RunRecord
from rackplane_wire import Assignment

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")


def parse_signal(name: str) -> signal.Signals | None:
    """`SIGUSR1`, `USR1` or `10` -> the signal; None when it is none."""
    name = name.strip().upper()
    if name.isdigit():
        try:
            return signal.Signals(int(name))
        except ValueError:
            return None
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        return None


def begin_stop(
    rec: RunRecord,
    driver: runtimes.Runtime,
    now: float,
    grace: float,
    deadline: float | None,
    why: str,
) -> None:
    """Ask the run to stop: SIGTERM now (once), and SIGKILL due at `rec.kill_at`."""
    rec.stop_seen_at = now
    rec.stopped = True
    rec.kill_at = now + grace if deadline is None else min(now + grace, deadline)
    if rec.term_sent_at is None:
        driver.signal(rec, signal.SIGTERM)
        rec.term_sent_at = now
    log.info(
        kv(
            "run_stopping",
            run=rec.key,
            pid=rec.pid,
            reason=why,
            kill_in_s=round(rec.kill_at - now, 2),
        )
    )


def kill(rec: RunRecord, driver: runtimes.Runtime, users: RunUsers, now: float) -> None:
    """SIGKILL a run whose grace is over, and whatever its uid left running."""
    driver.signal(rec, signal.SIGKILL)
    users.sweep(rec.uid)
    rec.kill_sent_at = now
    log.warning(
        kv(
            "run_killed",
            run=rec.key,
            pid=rec.pid,
            after_s=round(now - (rec.term_sent_at or now), 2),
        )
    )
    rec.save()


def checkpoint(
    rec: RunRecord, a: Assignment, driver: runtimes.Runtime, now: float, min_age_s: float
) -> None:
    """Send the run its checkpoint signal for the assignment's newest request (once it is old
    enough to have its handlers installed)."""
    if rec.started_at is not None and now - rec.started_at < min_age_s:
        return  # its handlers may not be installed yet: next pass
    sig = parse_signal(a.checkpoint_signal)
    if sig is None:
        log.warning(kv("checkpoint_signal_unknown", run=rec.key, signal=a.checkpoint_signal))
    else:
        driver.signal(rec, sig)
        log.info(
            kv(
                "checkpoint_requested",
                run=rec.key,
                signal=sig.name,
                request=a.checkpoint_requests,
            )
        )
    rec.checkpoints_sent = a.checkpoint_requests
    rec.save()
