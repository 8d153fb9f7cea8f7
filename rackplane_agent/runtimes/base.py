"""What every runtime shares: the shim's command line and the basic environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import rackplane_agent
from rackplane_wire import Assignment

# The only variables a run gets from the agent's own environment; the rest is the assignment's.
BASIC_ENV = ("PATH", "HOME", "LANG", "TZ")
# The directory holding the rackplane_agent package, so the shim can be found from any cwd.
_AGENT_ROOT = str(Path(rackplane_agent.__file__).resolve().parent.parent)


class StartError(Exception):
    """The run cannot start (reported as `failed_to_start` with this message)."""


def base_env(environ: Mapping[str, str] = os.environ, extra: tuple[str, ...] = ()) -> dict:
    keys = BASIC_ENV + ("PYTHONPATH",) + extra
    return {k: environ[k] for k in keys if k in environ}


class Runtime(Protocol):
    name: str

    def check(self, assignment: Assignment) -> None:
        """Raise StartError when the assignment cannot be started by this runtime."""

    def start(self, assignment: Assignment, run_dir: Path, cgroup: str | None) -> subprocess.Popen:
        """Start the run's shim; its pid leads the run's process group."""

    def killed(self, assignment: Assignment) -> None:
        """Called once when the agent SIGKILLs the run's group (clean up what it left)."""


def spawn_shim(
    argv: list[str],
    env: dict[str, str],
    run_dir: Path,
    *,
    exit_file: Path,
    output: Path,
    cgroup: str | None = None,
) -> subprocess.Popen:
    """Start `python -m rackplane_agent.shim ... -- argv` as a session leader in run_dir, its
    stdout and stderr appended to `output` by the process itself (no pipe to the agent)."""
    shim = [sys.executable, "-m", "rackplane_agent.shim", "--exit-file", str(exit_file)]
    if cgroup:
        shim += ["--cgroup", cgroup]
    # The shim must import rackplane_agent whatever the cwd; the run gets its own PYTHONPATH back.
    shim_env = dict(env)
    child_pythonpath = env.get("PYTHONPATH", "")
    shim_env["PYTHONPATH"] = os.pathsep.join(p for p in (_AGENT_ROOT, child_pythonpath) if p)
    shim += ["--pythonpath", child_pythonpath, "--", *argv]
    with open(output, "ab") as out:
        return subprocess.Popen(
            shim,
            cwd=run_dir,
            env=shim_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
