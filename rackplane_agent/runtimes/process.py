"""The `process` runtime: the assignment's argv, run on the host under the shim, as the run's
own uid in its own working directory (trusted pools only: it shares the host's kernel, files
and network)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.cgroups import Cgroups
from rackplane_agent.runtimes.base import (
    RunPlace,
    ShimRuntime,
    StartError,
    WorkloadStartError,
    base_env,
    spawn_shim,
)
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE, RunRecord
from rackplane_wire import Assignment


def run_env(
    assignment: Assignment, environ: Mapping[str, str], place: RunPlace | None = None
) -> dict[str, str]:
    """A few basics from the agent's environment, the run's HOME and TMPDIR, then the
    assignment's env (which may override them)."""
    env = base_env(environ)
    if place is not None:
        env.update(HOME=str(place.workdir), TMPDIR=str(place.tmp))
    return {**env, **assignment.env}


def start_dir(place: RunPlace, workdir: str | None) -> Path:
    """Where a process run starts: its own directory, or `workdir` under it, made now (the
    run's, as its directory is). The directory is fresh, nothing of the run's has run in it
    yet: no link in it can point elsewhere. A path that would leave it is refused."""
    if not workdir:
        return place.workdir
    parts = Path(workdir).parts
    if Path(workdir).is_absolute() or any(p in ("", ".", "..") for p in parts):
        raise WorkloadStartError(f"workdir {workdir!r} is not a path inside the run's directory")
    here = place.workdir
    for part in parts:
        here = here / part
        if here.is_symlink():
            raise WorkloadStartError(f"workdir {workdir!r} goes through a link")
        if not here.exists():
            here.mkdir(mode=0o770)
            if place.user is not None:
                os.chown(here, place.user.uid, place.user.gid)
    return here


def link_volumes(place: RunPlace) -> None:
    """Each volume as a link at its mount path in the run's own directory (the path's parents
    made as `start_dir` makes them). A process run shares the host's mount namespace: a link
    reaches the volume's directory, which its tenant's group may use and no one else's."""
    for v, host in place.volumes:
        parent, name = os.path.split(v.mount_path.rstrip("/"))
        where = start_dir(place, parent) if parent else place.workdir
        link = where / name
        if link.exists() or link.is_symlink():
            raise WorkloadStartError(f"volume {v.name}: {v.mount_path} is already there")
        os.symlink(host, link)
        if place.user is not None:
            os.lchown(link, place.user.uid, place.user.gid)


def resolve_command(argv0: str, path: str | None, cwd: Path) -> str:
    """Where argv[0] is: on PATH for a bare name, else relative to the run's directory."""
    if os.sep in argv0:
        full = argv0 if os.path.isabs(argv0) else os.path.join(cwd, argv0)
        if os.path.isfile(full) and os.access(full, os.X_OK):
            return full
        raise WorkloadStartError(f"command not found or not executable: {argv0}")
    found = shutil.which(argv0, path=path or os.defpath)
    if found is None:
        raise WorkloadStartError(f"command not found on PATH: {argv0}")
    return found


class ProcessRuntime(ShimRuntime):
    name = "process"

    def __init__(
        self,
        environ: Mapping[str, str] = os.environ,
        max_output: int | None = None,
        cgroups: Cgroups | None = None,
    ):
        self._environ = environ
        self._max_output = max_output
        self._cgroups = cgroups

    def check(self, assignment: Assignment) -> None:
        if not assignment.command or not assignment.command[0]:
            raise StartError("the command is empty")
        path = {**base_env(self._environ), **assignment.env}.get("PATH")
        resolve_command(assignment.command[0], path, Path("/nonexistent"))

    def launch(
        self,
        assignment: Assignment,
        env: dict[str, str],
        run_dir: Path,
        place: RunPlace,
        rec: RunRecord,
    ) -> subprocess.Popen:
        full = {**run_env(assignment, self._environ, place), **env}
        link_volumes(place)
        cwd = start_dir(place, assignment.workdir)
        resolve_command(assignment.command[0], full.get("PATH"), cwd)
        cgroup = None
        if self._cgroups is not None:
            cgroup = self._cgroups.create(rec.key, assignment.cpu_milli, assignment.memory_mib)
        try:
            popen = spawn_shim(
                list(assignment.command),
                full,
                run_dir,
                exit_file=run_dir / EXIT_FILE,
                output=run_dir / OUTPUT_FILE,
                host_env=base_env(self._environ),
                cwd=cwd,
                user=place.user,
                cgroup=cgroup,
                max_output=self._max_output,
            )
        except BaseException:
            if self._cgroups is not None:
                self._cgroups.remove(cgroup)
            raise
        rec.cgroup = cgroup
        return popen

    def destroy(self, rec: RunRecord) -> None:
        if self._cgroups is not None:
            self._cgroups.remove(rec.cgroup)
