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
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.logfmt import kv
from rackplane_agent.runtimes.base import StartError, base_env, spawn_shim
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE
from rackplane_wire import Assignment

log = logging.getLogger("rackplane_agent.podman")

# What rootless podman needs from the agent's environment, besides the basics.
PODMAN_ENV = ("XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "CONTAINERS_CONF", "CONTAINER_HOST")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def container_name(assignment: Assignment) -> str:
    wid = _NAME_UNSAFE.sub("_", assignment.workload_id)
    return f"rp-{wid}-{assignment.attempt}-{assignment.replica}"


def podman_argv(assignment: Assignment, podman: str = "podman") -> list[str]:
    """`podman run` for an assignment. The env values are not on the command line (any user
    may read a process's argv, and the env carries RACKPLANE_TOKEN): `--env NAME` takes each
    from podman's own environment, which is the assignment's env."""
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
    for name in assignment.env:
        argv += ["--env", name]
    if assignment.cpu_milli > 0:
        argv += ["--cpus", f"{assignment.cpu_milli / 1000:g}"]
    if assignment.memory_mib > 0:
        argv += ["--memory", f"{assignment.memory_mib}m"]
    argv += ["--stop-timeout", str(math.ceil(assignment.grace_s))]
    argv += [assignment.image, *assignment.command]
    return argv


def podman_env(assignment: Assignment, environ: Mapping[str, str]) -> dict[str, str]:
    return {**base_env(environ, PODMAN_ENV), **assignment.env}


class PodmanRuntime:
    name = "podman"

    def __init__(self, environ: Mapping[str, str] = os.environ):
        self._environ = environ

    def _podman(self) -> str:
        found = shutil.which("podman", path=self._environ.get("PATH"))
        if found is None:
            raise StartError("podman is not installed on this node")
        return found

    def check(self, assignment: Assignment) -> None:
        podman_argv(assignment, self._podman())

    def start(self, assignment: Assignment, run_dir: Path, cgroup: str | None) -> subprocess.Popen:
        argv = podman_argv(assignment, self._podman())
        # Podman applies the limits itself (--cpus, --memory): no cgroup of ours around it.
        return spawn_shim(
            argv,
            podman_env(assignment, self._environ),
            run_dir,
            exit_file=run_dir / EXIT_FILE,
            output=run_dir / OUTPUT_FILE,
        )

    def killed(self, assignment: Assignment) -> None:
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
