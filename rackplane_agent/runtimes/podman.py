"""The `podman` runtime: `podman run` under the shim, the GPUs given as CDI devices.

`podman run` proxies the signals it gets to the container (`--sig-proxy`, on by default), so
SIGTERM and the checkpoint signal reach the workload like a host process's. A SIGKILL cannot be
proxied: when the agent kills the group it also asks podman to kill the container.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.logfmt import kv
from rackplane_agent.runtimes.base import RunPlace, ShimRuntime, StartError, base_env, spawn_shim
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE, RunRecord
from rackplane_wire import Assignment

log = logging.getLogger("rackplane_agent.podman")

# What podman needs from the agent's environment (never the workload's), besides the basics.
PODMAN_ENV = (
    "HOME",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "CONTAINER_HOST",
)
# The fd on which the shim hands podman the workload's env (`--env-file /dev/fd/N`).
ENV_FD = 20
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def container_name(assignment: Assignment) -> str:
    wid = _NAME_UNSAFE.sub("_", assignment.workload_id)
    return f"rp-{wid}-{assignment.attempt}-{assignment.replica}"


def podman_argv(assignment: Assignment, podman: str = "podman") -> list[str]:
    """`podman run` for an assignment. The env is neither on the command line (any user may
    read a process's argv, and the env carries RACKPLANE_TOKEN) nor in podman's own
    environment (where PATH, LD_PRELOAD or CONTAINERS_CONF would steer podman itself): the shim
    hands it over on a pipe (`--env-file /dev/fd/N`). `--` ends podman's options, so no image
    name is read as one."""
    if not assignment.image:
        raise StartError("the podman runtime needs an image")
    argv = [
        podman,
        "run",
        "--rm",
        "--name",
        container_name(assignment),
        "--label",
        f"rackplane.workload={assignment.workload_id}",
        "--label",
        f"rackplane.attempt={assignment.attempt}",
        "--label",
        f"rackplane.replica={assignment.replica}",
    ]
    for device in assignment.devices:
        argv += ["--device", f"nvidia.com/gpu={device}"]
    argv += ["--env-file", f"/dev/fd/{ENV_FD}"]
    if assignment.cpu_milli > 0:
        argv += ["--cpus", f"{assignment.cpu_milli / 1000:g}"]
    if assignment.memory_mib > 0:
        argv += ["--memory", f"{assignment.memory_mib}m"]
    argv += ["--stop-timeout", str(math.ceil(assignment.grace_s))]
    argv += ["--", assignment.image, *assignment.command]
    return argv


def check_env(env: dict[str, str]) -> None:
    """An env-file line holds one `NAME=value`: a value with a line break cannot be passed."""
    broken = sorted(k for k, v in env.items() if "\n" in v or "\r" in v)
    if broken:
        raise StartError(
            f"env {', '.join(broken)} holds a line break, which the podman runtime cannot pass"
        )


class PodmanRuntime(ShimRuntime):
    name = "podman"

    def __init__(self, environ: Mapping[str, str] = os.environ, max_output: int | None = None):
        self._environ = environ
        self._max_output = max_output

    def _podman(self) -> str:
        found = shutil.which("podman", path=self._environ.get("PATH"))
        if found is None:
            raise StartError("podman is not installed on this node")
        return found

    def check(self, assignment: Assignment) -> None:
        podman_argv(assignment, self._podman())
        check_env(assignment.env)

    def launch(
        self,
        assignment: Assignment,
        env: dict[str, str],
        run_dir: Path,
        place: RunPlace,
        rec: RunRecord,
    ) -> subprocess.Popen:
        argv = podman_argv(assignment, self._podman())
        full = {**assignment.env, **env}
        check_env(full)
        # Podman applies the limits itself (--cpus, --memory): no cgroup of ours around it.
        return spawn_shim(
            argv,
            full,
            run_dir,
            exit_file=run_dir / EXIT_FILE,
            output=run_dir / OUTPUT_FILE,
            host_env=base_env(self._environ, PODMAN_ENV),
            cwd=place.workdir,
            env_fd=ENV_FD,
            max_output=self._max_output,
        )

    def signal(self, rec: RunRecord, sig: int) -> bool:
        """`podman run` proxies signals to the container, but a SIGKILL cannot be proxied:
        then the container is removed too."""
        sent = super().signal(rec, sig)
        if sig == signal.SIGKILL:
            self._remove(Assignment.model_validate(rec.assignment))
        return sent

    def _remove(self, assignment: Assignment) -> None:
        name = container_name(assignment)

        def kill() -> None:
            try:
                subprocess.run(
                    [self._podman(), "rm", "--force", "--time", "0", name],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=60,
                    check=False,
                )
            except (OSError, StartError, subprocess.TimeoutExpired) as exc:
                log.warning(kv("podman_kill_failed", container=name, error=exc))

        threading.Thread(target=kill, name=f"podman-rm-{name}", daemon=True).start()
