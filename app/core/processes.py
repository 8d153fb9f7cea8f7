"""Child processes that run in their own process group (a Celery worker forks its pool and, with
beat, a beat process: stopping only the leader can orphan them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def stop_groups(children: list[subprocess.Popen], timeout: float = 20.0) -> None:
    """Warm shutdown (SIGTERM) of each child's process group, started with
    `start_new_session=True`; SIGKILL to whatever of a group is left after `timeout`."""
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
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
