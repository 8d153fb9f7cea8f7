"""The agent's configuration: what the command line says, and the timings tests shorten."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = "/var/lib/rackplane-agent"

# Exit codes of `python -m rackplane_agent`.
EXIT_OK = 0  # stopped by SIGTERM/SIGINT (its runs are left running)
EXIT_ERROR = 1  # an unexpected error
EXIT_USAGE = 2  # cannot start: no join token, a refused token, no inventory, a busy state dir
EXIT_REVOKED = 3  # the control plane refused the node's credential (its runs are left running)


def default_state_dir() -> Path:
    return Path(os.environ.get("RACKPLANE_AGENT_STATE_DIR") or DEFAULT_STATE_DIR)


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

    @property
    def runs_dir(self) -> Path:
        return self.state_dir / "runs"
