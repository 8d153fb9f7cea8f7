"""The state directory: the node's credential, and one directory per run.

    <state>/credential            the node credential (rpn_...), mode 0600
    <state>/node.json             the node's name and id, as the join answered
    <state>/agent.lock            held (flock) by the one agent using this directory
    <state>/ssh-port              the last SSH port the agent handed out (they go in turn)
    <state>/ssh-bundle/           the SSH server the podman runtime brings into containers
    <state>/runs/<wid>.<attempt>.<replica>/
        run.json                  what the agent knows of the run (`RunRecord`)
        launch.json               what the shim starts (argv, env with secrets, uid), removed
                                  by the shim as soon as it has read it
        output.log                the process's stdout and stderr, as the shim copies them
        exit.json                 written by the shim when the process ends

The directory is the agent's alone (0700): runs work elsewhere, in the work directory, as
their own uid (`rackplane_agent.runusers`).

Everything is written atomically (a temporary file, then a rename), so a crash leaves either
the old or the new content.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
OUTPUT_FILE = "output.log"
EXIT_FILE = "exit.json"

# A run's states (`RunRecord.state`): running, then one of three ends.
RUNNING, EXITED, FAILED_TO_START, LOST = "running", "exited", "failed_to_start", "lost"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class StateDirBusy(Exception):
    """Another agent holds the state directory."""


def iso(ts: float) -> str:
    """Epoch seconds -> ISO 8601 in local time, with its offset."""
    return datetime.fromtimestamp(ts).astimezone().isoformat()


def write_atomic(path: Path, data: bytes, mode: int = 0o644, *, sync: bool = True) -> None:
    """Replace `path` with `data` at once. `sync=False`: not forced to the disk (what only
    lives until a process reads it, as a run's launch file with its secrets, need not stay
    there after a power cut; the agent sweeps what is left at its start)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def run_key(workload_id: str, attempt: int, replica: int) -> str:
    return f"{workload_id}.{attempt}.{replica}"


def run_dir_name(workload_id: str, attempt: int, replica: int) -> str:
    return f"{_UNSAFE.sub('_', workload_id)}.{attempt}.{replica}"


@dataclass
class RunRecord:
    """One run, as `run.json` keeps it. Times are epoch seconds (the agent's wall clock)."""

    workload_id: str
    attempt: int
    replica: int
    assignment: dict[str, Any]
    # RUNNING | EXITED | FAILED_TO_START | LOST
    state: str = RUNNING
    pid: int | None = None
    create_time: float | None = None  # psutil's, to tell our process from a reused pid
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    message: str | None = None
    # Whose a start failure is: "workload" (its command or image; it would fail anywhere) or
    # None (the node's: no port, a device gone, a runtime broken).
    fault: str | None = None
    stopped: bool = False
    grace_s: float = 10.0
    stop_seen_at: float | None = None  # when the agent first saw a reason to stop it
    term_sent_at: float | None = None
    kill_at: float | None = None
    kill_sent_at: float | None = None
    checkpoints_sent: int = 0
    log_offset: int = 0  # bytes of output.log the control plane acknowledged
    cgroup: str | None = None
    uid: int | None = None  # the run's own uid (None: the agent's)
    workdir: str | None = None  # its working directory, under the work directory
    # An instance's SSH endpoint: the node's port the agent picked for it (`podman` and `vm`
    # runs with SSH keys), and whether an SSH server has answered there since it started.
    ssh_port: int | None = None
    ssh_ready: bool = False
    # A serving run's endpoint (rackplane_agent/serving.py): the node's port it is reached on,
    # and whether its readiness path has answered 2xx since it started.
    serve_port: int | None = None
    serve_ready: bool = False
    # --- not persisted ---
    run_dir: Path = field(default=Path("."), metadata={"persist": False})
    version: int = field(default=1, metadata={"persist": False})
    acked_version: int = field(default=0, metadata={"persist": False})
    popen: Any = field(default=None, repr=False, metadata={"persist": False})

    @property
    def key(self) -> str:
        return run_key(self.workload_id, self.attempt, self.replica)

    @property
    def output(self) -> Path:
        return self.run_dir / OUTPUT_FILE

    @property
    def exit_file(self) -> Path:
        return self.run_dir / EXIT_FILE

    def to_json(self) -> bytes:
        data = {
            f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("persist", True)
        }
        return json.dumps(data, indent=1, sort_keys=True).encode()

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        data = json.loads((run_dir / RUN_FILE).read_text())
        known = {f.name for f in fields(cls) if f.metadata.get("persist", True)}
        rec = cls(**{k: v for k, v in data.items() if k in known})
        rec.run_dir = run_dir
        return rec

    def save(self) -> None:
        write_atomic(self.run_dir / RUN_FILE, self.to_json(), 0o600)


def read_exit(path: Path) -> dict[str, Any] | None:
    """The shim's exit record, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class StateDir:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.runs = self.root / "runs"
        self._lock_fd: int | None = None
        self._alive_fd: int | None = None

    @property
    def alive_file(self) -> Path:
        return self.root / "runs-seen-alive"

    def mark_alive(self, at: float) -> None:
        """When this agent last saw its running runs' processes alive: a restarted agent ends
        a run it finds gone then (its usage ends there, not when the agent came back). Written
        in place, not synced: after a power cut the file holds this time or an earlier one,
        never a later one."""
        if self._alive_fd is None:
            self._alive_fd = os.open(self.alive_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.pwrite(self._alive_fd, f"{at:20.3f}\n".encode(), 0)

    def seen_alive(self) -> float | None:
        """The time `mark_alive` last wrote (None: never, or unreadable)."""
        try:
            return float(self.alive_file.read_text().strip())
        except (OSError, ValueError):
            return None

    @property
    def credential_file(self) -> Path:
        return self.root / "credential"

    @property
    def node_file(self) -> Path:
        return self.root / "node.json"

    def ensure(self) -> None:
        for d in (self.root, self.runs):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    def lock(self) -> None:
        fd = os.open(self.root / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StateDirBusy(f"another agent is using {self.root}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._alive_fd is not None:
            os.close(self._alive_fd)
            self._alive_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def read_credential(self) -> str | None:
        try:
            value = self.credential_file.read_text().strip()
        except FileNotFoundError:
            return None
        return value or None

    def write_credential(self, credential: str, node: dict[str, Any]) -> None:
        write_atomic(self.credential_file, credential.encode() + b"\n", 0o600)
        self.write_node(node)

    def read_node(self) -> dict[str, Any]:
        try:
            data = json.loads(self.node_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write_node(self, node: dict[str, Any]) -> None:
        write_atomic(self.node_file, json.dumps(node, indent=1, sort_keys=True).encode(), 0o600)

    @property
    def ssh_port_file(self) -> Path:
        return self.root / "ssh-port"

    def read_ssh_port(self) -> int | None:
        """The last SSH port handed out (None: none yet, or unreadable)."""
        try:
            text = self.ssh_port_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def write_ssh_port(self, port: int) -> None:
        write_atomic(self.ssh_port_file, f"{port}\n".encode(), 0o600)

    def run_dir(self, workload_id: str, attempt: int, replica: int) -> Path:
        return self.runs / run_dir_name(workload_id, attempt, replica)

    def run_dirs(self) -> list[Path]:
        if not self.runs.is_dir():
            return []
        return sorted(p for p in self.runs.iterdir() if p.is_dir() and not p.name.startswith("."))

    def sweep_launch_files(self, older_than_s: float = 60.0) -> int:
        """Remove launch files a shim never read (a crash between writing one and the shim's
        start): each holds a run's whole env, its secrets among it. One younger than
        `older_than_s` may still be read by a shim starting now, and is left."""
        gone = 0
        cutoff = time.time() - older_than_s
        for run_dir in self.run_dirs():
            for f in run_dir.glob("*launch.json*"):
                try:
                    if f.stat().st_mtime < cutoff:
                        f.unlink()
                        gone += 1
                except OSError:
                    pass
        return gone

    @staticmethod
    def remove_run(run_dir: Path) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
