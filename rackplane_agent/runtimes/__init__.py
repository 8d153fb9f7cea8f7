"""How a run's process is started: `process` (argv on the host) and `podman` (a container).

Both start the same thing, the shim (`rackplane_agent.shim`) in a new session and process group
writing to the run's output.log, so the agent treats every run alike: signals go to the
group, the exit is read from the exit file, and an agent restart leaves the run alone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from rackplane_agent.runtimes.base import Runtime, StartError, base_env

__all__ = ["Runtime", "StartError", "available", "base_env", "make"]


def available(requested: list[str] | None = None) -> list[str]:
    """The runtimes to offer: `process` always; `podman` when it is installed (and asked for,
    when `requested` names runtimes). Raises ValueError for a requested one that is missing."""
    found = ["process"] + (["podman"] if shutil.which("podman") else [])
    if requested is None:
        return found
    for name in requested:
        if name not in ("process", "podman"):
            raise ValueError(f"unknown runtime {name!r}")
        if name not in found:
            raise ValueError(f"runtime {name!r} is not available on this host (not on PATH)")
    return ["process"] + [n for n in ("podman",) if n in requested]


def make(name: str, environ: Mapping[str, str] = os.environ) -> Runtime:
    if name == "process":
        from rackplane_agent.runtimes.process import ProcessRuntime

        return ProcessRuntime(environ)
    if name == "podman":
        from rackplane_agent.runtimes.podman import PodmanRuntime

        return PodmanRuntime(environ)
    raise ValueError(f"unknown runtime {name!r}")
