"""Child processes that run in their own process group (a Celery worker forks its pool and, with
beat, a beat process: stopping only the leader can orphan them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def stop_groups(children: list[subprocess.Popen], timeout: float = 20.0) -> None:
    """Warm shutdown of each child, started with `start_new_session=True`: SIGTERM to its
    leader alone (a Celery worker then lets running tasks finish and stops its own pool and
    beat; SIGTERM to the whole group killed the pool under it, which it restarted and waited
    out, 20-60 s), then SIGKILL to whatever of the group is left after `timeout`."""
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        while True:  # the group outlives its leader by a moment while its children exit
            try:
                os.killpg(child.pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=1)
                break
            time.sleep(0.1)
