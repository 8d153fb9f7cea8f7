"""The `process` runtime: the assignment's argv, run on the host under the shim."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.runtimes.base import StartError, base_env, spawn_shim
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE
from rackplane_wire import Assignment


def run_env(assignment: Assignment, environ: Mapping[str, str]) -> dict[str, str]:
    """A few basics from the agent's environment, then the assignment's env exactly."""
    return {**base_env(environ), **assignment.env}


def resolve_command(argv0: str, path: str | None, cwd: Path) -> str:
    """Where argv[0] is: on PATH for a bare name, else relative to the run's directory."""
    if os.sep in argv0:
        full = argv0 if os.path.isabs(argv0) else os.path.join(cwd, argv0)
        if os.path.isfile(full) and os.access(full, os.X_OK):
            return full
        raise StartError(f"command not found or not executable: {argv0}")
    found = shutil.which(argv0, path=path or os.defpath)
    if found is None:
        raise StartError(f"command not found on PATH: {argv0}")
    return found


class ProcessRuntime:
    name = "process"

    def __init__(self, environ: Mapping[str, str] = os.environ):
        self._environ = environ

    def check(self, assignment: Assignment) -> None:
        if not assignment.command or not assignment.command[0]:
            raise StartError("the command is empty")
        env = run_env(assignment, self._environ)
        resolve_command(assignment.command[0], env.get("PATH"), Path("/nonexistent"))

    def start(self, assignment: Assignment, run_dir: Path, cgroup: str | None) -> subprocess.Popen:
        env = run_env(assignment, self._environ)
        resolve_command(assignment.command[0], env.get("PATH"), run_dir)
        return spawn_shim(
            list(assignment.command),
            env,
            run_dir,
            exit_file=run_dir / EXIT_FILE,
            output=run_dir / OUTPUT_FILE,
            cgroup=cgroup,
        )

    def killed(self, assignment: Assignment) -> None:
        pass
