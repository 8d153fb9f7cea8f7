"""The agent's configuration: what the command line says, and the timings tests shorten."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = "/var/lib/rackplane-agent"
# Each run's own uid (and gid of the same number) comes from this range, which no account on
# the host should use (above the subordinate ids podman and useradd hand out by default).
DEFAULT_RUN_UIDS = (2_000_000, 2_065_535)
DEFAULT_MAX_OUTPUT_MIB = 16
# The node's TCP ports an instance's SSH server is reached on (`--ssh-ports`), one per run.
DEFAULT_SSH_PORTS = (22000, 22999)
DEFAULT_SERVE_PORTS = (31000, 31999)

# Exit codes of `python -m rackplane_agent`.
EXIT_OK = 0  # stopped by SIGTERM/SIGINT (its runs are left running)
EXIT_ERROR = 1  # an unexpected error
EXIT_USAGE = 2  # cannot start: no join token, a refused token, no inventory, a busy state dir
EXIT_REVOKED = 3  # the control plane refused the node's credential (its runs are left running)


def default_state_dir() -> Path:
    return Path(os.environ.get("RACKPLANE_AGENT_STATE_DIR") or DEFAULT_STATE_DIR)


def parse_uid_range(text: str) -> tuple[int, int]:
    """`2000000-2065535` -> (2000000, 2065535); ValueError for anything else."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"a uid range is FIRST-LAST, e.g. 2000000-2065535 (got {text!r})")
    first, last = int(low), int(high)
    if not 1000 <= first <= last < 2**32 - 1:
        raise ValueError(f"uid range {text!r} must lie within 1000-{2**32 - 2}, first <= last")
    return first, last


def parse_port_range(text: str) -> tuple[int, int]:
    """`22000-22999` -> (22000, 22999); ValueError for anything else."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"a port range is LO-HI, e.g. 22000-22999 (got {text!r})")
    return check_port_range((int(low), int(high)))


def check_port_range(ports: tuple[int, int]) -> tuple[int, int]:
    first, last = ports
    if not 1 <= first <= last <= 65_535:
        raise ValueError(f"port range {first}-{last} must lie within 1-65535, first <= last")
    return first, last


@dataclass
class AgentConfig:
    api: str
    state_dir: Path = field(default_factory=default_state_dir)
    token: str | None = None
    inventory_file: Path | None = None
    address: str | None = None
    # The runtimes this agent offers; None: `process`, and `podman` when it is installed.
    runtimes: list[str] | None = None
    dcgm_exporter: str | None = None
    poll_wait: float = 30.0
    # --- timings (seconds) ---
    reconcile_interval: float = 0.25
    log_interval: float = 1.0
    telemetry_interval: float = 10.0
    # Heartbeat until the control plane's `Assignments.heartbeat_s` is known.
    heartbeat_s: float = 10.0
    # A checkpoint signal waits until the run has been up this long (its handlers installed).
    checkpoint_min_age_s: float = 1.0
    request_timeout: float = 10.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    # cgroup v2 limits when the host delegates a writable subtree; False: never try.
    cgroups: bool = True
    # Where runs work (each its own directory, owned by its uid): outside the state directory,
    # which is the agent's alone. None: `<state_dir>-work` beside it.
    work_dir: Path | None = None
    # The uids runs get, one each. "auto": DEFAULT_RUN_UIDS when the agent runs as root, else
    # none; None: every run as the agent's own user (a single-user machine only).
    run_uids: tuple[int, int] | str | None = "auto"
    # A run's output kept on the node's disk while it runs (past it, only the newest 64 KiB).
    max_output_mib: int = DEFAULT_MAX_OUTPUT_MIB
    # The node's ports an instance's SSH server is forwarded from (`podman` and `vm` runs with
    # SSH keys), one per live run, first and last included.
    ssh_ports: tuple[int, int] = DEFAULT_SSH_PORTS
    # The node's ports a serving run (an inference endpoint's replica) is reached on.
    serve_ports: tuple[int, int] = DEFAULT_SERVE_PORTS
    # Tenants' volumes on this node's disk (None: `<state_dir>-volumes` beside the state
    # directory), and on the fleet's shared storage this host mounts (None: it has none).
    volumes_dir: Path | None = None
    shared_volumes_dir: Path | None = None
    # The host's interface for traffic between a gang's hosts: NCCL's and Gloo's socket
    # interface for its runs (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`; a run's own env wins).
    data_interface: str | None = None

    def __post_init__(self) -> None:
        # Absolute, whatever the cwd of the processes that use them (the shim runs in its run's
        # directory).
        self.state_dir = Path(self.state_dir).absolute()
        if self.work_dir is None:
            self.work_dir = self.state_dir.with_name(self.state_dir.name + "-work")
        self.work_dir = Path(self.work_dir).absolute()
        if self.volumes_dir is None:
            self.volumes_dir = self.state_dir.with_name(self.state_dir.name + "-volumes")
        self.volumes_dir = Path(self.volumes_dir).absolute()
        if self.shared_volumes_dir is not None:
            self.shared_volumes_dir = Path(self.shared_volumes_dir).absolute()
        if self.inventory_file is not None:
            self.inventory_file = Path(self.inventory_file).absolute()
        self.ssh_ports = check_port_range(tuple(self.ssh_ports))  # type: ignore[arg-type]
        self.serve_ports = check_port_range(tuple(self.serve_ports))  # type: ignore[arg-type]

    def uid_range(self, euid: int) -> tuple[int, int] | None:
        if self.run_uids == "auto":
            return DEFAULT_RUN_UIDS if euid == 0 else None
        if isinstance(self.run_uids, str):
            return parse_uid_range(self.run_uids)
        return self.run_uids

    @property
    def runs_dir(self) -> Path:
        return self.state_dir / "runs"
