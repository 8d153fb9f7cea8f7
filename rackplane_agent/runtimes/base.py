"""What every runtime shares: how a run is launched through the shim, and who it runs as.

A run's host-side helpers (the shim, podman) get a fixed environment of the agent's choosing;
the workload's env reaches only the workload (`Launch.env`), handed over in a launch file in the
run's state directory that the shim reads and removes. The run itself works in a directory of
its own outside the agent's state directory, as its own uid where the agent can give it one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

import rackplane_agent
from rackplane_agent.logfmt import kv
from rackplane_agent.state import RunRecord, read_exit, write_atomic
from rackplane_wire import Assignment, Inventory, VolumeMount

log = logging.getLogger("rackplane_agent.runtimes")
CREATE_TIME_SLACK = 0.05

# The only variables a run gets from the agent's own environment; the rest is the assignment's.
BASIC_ENV = ("PATH", "LANG", "TZ")
LAUNCH_FILE = "launch.json"
# The directory holding the rackplane_agent package, so the shim can be found from any cwd.
_AGENT_ROOT = str(Path(rackplane_agent.__file__).resolve().parent.parent)


class StartError(Exception):
    """The run cannot start (reported as `failed_to_start` with this message)."""


class WorkloadStartError(StartError):
    """The run cannot start because of the workload itself (its command is not there or not
    executable): on any node it would fail the same way, so the control plane fails it at once
    instead of placing it again (reported with `fault: workload`)."""


@dataclass(frozen=True)
class RunUser:
    """The unprivileged identity a run's processes have (None: the agent's own)."""

    uid: int
    gid: int


@dataclass(frozen=True)
class RunPlace:
    """Where and as whom a run works: its own directory (its cwd and HOME, with a private
    `tmp/` as TMPDIR), owned by its user."""

    workdir: Path
    user: RunUser | None
    # The tenant's volumes it mounts, each with its directory on this node.
    volumes: tuple[tuple[VolumeMount, Path], ...] = ()

    @property
    def tmp(self) -> Path:
        return self.workdir / "tmp"


def base_env(environ: Mapping[str, str] = os.environ, extra: tuple[str, ...] = ()) -> dict:
    keys = BASIC_ENV + extra
    return {k: environ[k] for k in keys if k in environ}


class Runtime(Protocol):
    """A driver, as Nomad's (`plugins/drivers/driver.go`): the verbs the agent's runner uses,
    never asking which runtime it has."""

    name: str
    # Whether the run's processes take the run's own host uid (a container's or a VM's are
    # walled by their namespaces or their hypervisor instead, and take none).
    own_uid: bool
    # Whether a run with SSH keys is an instance one logs into through a port of the node (the
    # agent picks the port and hands it over as `ssh_port`).
    serves_ssh: bool

    def check(self, assignment: Assignment) -> None:
        """Raise StartError when the assignment cannot be started by this runtime."""

    def start(
        self, rec: RunRecord, assignment: Assignment, env: dict[str, str], place: RunPlace
    ) -> None:
        """Start the run (`env`: the workload's whole environment, secrets included), filling
        in what identifies it (`rec.pid`, `rec.create_time`, ...). Raises StartError."""

    def recover(self, rec: RunRecord) -> bool:
        """A run found in the state directory after the agent restarted: still running?"""

    def running(self, rec: RunRecord) -> bool:
        """Whether the run still runs (never blocks)."""

    def exit(self, rec: RunRecord) -> dict[str, Any] | None:
        """How the run ended (`exit_code`, `signal`, `at`), if it left a record of it."""

    def signal(self, rec: RunRecord, sig: int) -> bool:
        """Send `sig` to the run (SIGKILL: and whatever of it lives outside its processes);
        False when it is gone."""

    def destroy(self, rec: RunRecord) -> None:
        """The run is over and forgotten: free what the runtime holds for it."""

    def use_inventory(self, inventory: Inventory) -> None:
        """The host's inventory, as the agent read it (at start and on every re-read): what a
        runtime needs of it (the `vm` runtime: each GPU's PCI bus id)."""

    def capabilities(self) -> list[str]:
        """What this runtime can do on this host that the inventory should advertise (the
        `vm` runtime: `sev-snp`, `tdx`)."""

    def forwarded_ports(self) -> set[int]:
        """The node's TCP ports this runtime's host plumbing forwards somewhere now (podman:
        netavark's DNAT rules, a container's own or one left behind), which the agent must
        not hand out as an instance's SSH port: such a rule catches the port's traffic before
        any listener does."""


def signal_group(pid: int | None, sig: int) -> bool:
    """Signal a run's process group (its shim leads it); False when it is gone."""
    if not pid:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        log.warning(kv("signal_refused", pid=pid, signal=signal.Signals(sig).name, error=exc))
        return False


class ShimRuntime:
    """The verbs of a runtime whose run is a shim's process group (process, podman): liveness
    by the shim's pid and start time, the exit from its exit file, signals to its group."""

    name = "shim"
    own_uid = True
    serves_ssh = False

    def check(self, assignment: Assignment) -> None:
        raise StartError(f"the {self.name} runtime cannot start runs")

    def launch(
        self,
        assignment: Assignment,
        env: dict[str, str],
        run_dir: Path,
        place: RunPlace,
        rec: RunRecord,
    ) -> subprocess.Popen:
        """Start the run's shim; its pid leads the run's process group."""
        raise StartError(f"the {self.name} runtime cannot start runs")

    def start(
        self, rec: RunRecord, assignment: Assignment, env: dict[str, str], place: RunPlace
    ) -> None:
        popen = self.launch(assignment, env, rec.run_dir, place, rec)
        rec.popen, rec.pid = popen, popen.pid
        try:
            rec.create_time = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            rec.create_time = None  # already gone: the next pass sees its exit

    def running(self, rec: RunRecord) -> bool:
        if rec.pid is None:
            return False
        if rec.popen is not None:
            return rec.popen.poll() is None  # reaps our own child
        try:  # a child of this process that another Agent object started (tests), reaped here
            pid, _ = os.waitpid(rec.pid, os.WNOHANG)
            if pid == rec.pid:
                return False
        except ChildProcessError:
            pass
        try:
            proc = psutil.Process(rec.pid)
            if rec.create_time is not None:
                if abs(proc.create_time() - rec.create_time) > CREATE_TIME_SLACK:
                    return False  # the pid was reused
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True

    def recover(self, rec: RunRecord) -> bool:
        return self.running(rec)  # the shim outlives the agent: its pid is the run's

    def exit(self, rec: RunRecord) -> dict[str, Any] | None:
        return read_exit(rec.exit_file)

    def signal(self, rec: RunRecord, sig: int) -> bool:
        return signal_group(rec.pid, sig)

    def destroy(self, rec: RunRecord) -> None:
        pass

    def use_inventory(self, inventory: Inventory) -> None:
        pass

    def capabilities(self) -> list[str]:
        return []

    def forwarded_ports(self) -> set[int]:
        return set()


def spawn_shim(
    argv: list[str],
    env: dict[str, str],
    run_dir: Path,
    *,
    exit_file: Path,
    output: Path,
    host_env: dict[str, str],
    cwd: Path | None = None,
    user: RunUser | None = None,
    env_fd: int | None = None,
    cgroup: str | None = None,
    max_output: int | None = None,
) -> subprocess.Popen:
    """Start `python -m rackplane_agent.shim` as a session leader in run_dir, in `host_env`
    (plus what finds the shim), its stdout and stderr appended to `output` by the process
    itself (no pipe to the agent). The child's argv, env, cwd and user go in the launch file."""
    launch = {
        "argv": argv,
        "env": env,
        "cwd": str(cwd) if cwd is not None else None,
        "uid": user.uid if user else None,
        "gid": user.gid if user else None,
        "env_fd": env_fd,
        # A run's files are its tenant's (group) and nobody else's; the agent's own user keeps
        # the usual umask.
        "umask": 0o007 if user else 0o022,
    }
    launch_file = run_dir / LAUNCH_FILE
    # It holds the run's whole env (its secrets, its token) until the shim reads and removes
    # it: not synced to the disk, and swept at the agent's start if a crash left it.
    write_atomic(launch_file, json.dumps(launch).encode(), 0o600, sync=False)
    shim = [sys.executable, "-m", "rackplane_agent.shim", "--exit-file", str(exit_file)]
    shim += ["--launch", str(launch_file)]
    if cgroup:
        shim += ["--cgroup", cgroup]
    if max_output is not None:
        shim += ["--max-output", str(max_output)]
    shim_env = {**host_env, "PYTHONPATH": _AGENT_ROOT}
    try:
        with open(output, "ab") as out:
            os.chmod(output, 0o600)
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
    except BaseException:
        launch_file.unlink(missing_ok=True)
        raise
