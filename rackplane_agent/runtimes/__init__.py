"""The runtimes, as drivers (`base.Runtime`): `process` (argv on the host, as the run's own
uid), `podman` (a container) and `vm` (a QEMU/KVM virtual machine, `vm.py`). The runner uses
their verbs (start, recover, running, exit, signal, destroy) and never asks which one it has.

All here run a shim (`rackplane_agent.shim`) in a new session and process group writing to
the run's output.log (`base.ShimRuntime`): signals go to the group, the exit is read from the
exit file, and an agent restart leaves the run alone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.cgroups import Cgroups
from rackplane_agent.runtimes.base import (
    RunPlace,
    Runtime,
    RunUser,
    ShimRuntime,
    StartError,
    WorkloadStartError,
    base_env,
)

__all__ = [
    "RunPlace",
    "RunUser",
    "Runtime",
    "ShimRuntime",
    "StartError",
    "WorkloadStartError",
    "available",
    "base_env",
    "make",
]


OPTIONAL = ("podman", "vm")
# What each optional runtime needs on PATH.
NEEDS = {"podman": ("podman",), "vm": ("qemu-system-x86_64", "qemu-img")}


def available(requested: list[str] | None = None) -> list[str]:
    """The runtimes to offer: `process` always; `podman` and `vm` when what they need is
    installed (and asked for, when `requested` names runtimes). Raises ValueError for a
    requested one that is missing."""
    found = ["process"] + [n for n in OPTIONAL if all(shutil.which(tool) for tool in NEEDS[n])]
    if requested is None:
        return found
    for name in requested:
        if name not in ("process", *OPTIONAL):
            raise ValueError(f"unknown runtime {name!r}")
        if name not in found:
            raise ValueError(f"runtime {name!r} is not available on this host (not on PATH)")
    return ["process"] + [n for n in OPTIONAL if n in requested]


def make(
    name: str,
    environ: Mapping[str, str] = os.environ,
    max_output: int | None = None,
    cgroups: Cgroups | None = None,
    state_dir: Path | None = None,
) -> Runtime:
    """A runtime; `state_dir`: the agent's, where a runtime keeps what it builds (podman: the
    SSH server it brings into containers, `<state_dir>/ssh-bundle`)."""
    if name == "process":
        from rackplane_agent.runtimes.process import ProcessRuntime

        return ProcessRuntime(environ, max_output, cgroups)
    if name == "podman":
        from rackplane_agent.runtimes.podman import PodmanRuntime

        ssh_dir = Path(state_dir) / "ssh-bundle" if state_dir is not None else None
        return PodmanRuntime(environ, max_output, ssh_dir)
    if name == "vm":
        from rackplane_agent.runtimes.vm import VmRuntime

        return VmRuntime(environ, max_output)
    raise ValueError(f"unknown runtime {name!r}")
