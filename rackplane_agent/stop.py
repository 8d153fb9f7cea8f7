"""`rackplane agent stop`: stop the agent of one state directory, and only it (never another
user's agent or job, as `pkill -f` would on a shared host).

The agent holds `<state-dir>/agent.lock` (an flock) for as long as it runs, and writes its pid
there: a pid file that cannot go stale, since a held lock is the proof that the pid is still
that agent. `stop` sends it SIGTERM (`--kill`: SIGKILL, as a crash would) and waits until the
lock is free; the runs keep running, as they do whenever the agent stops. `--power-cut` also
kills every process of the runs recorded in that directory (each run's process group, checked
against its recorded start time), as a power cut would: what a restarted agent then finds is a
node whose work is gone. Container and VM runs are stopped through their process groups too;
their engines' state (podman's, QEMU's) is what a reboot would leave.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import time
from pathlib import Path

import psutil

from rackplane_agent.config import default_state_dir
from rackplane_agent.state import RunRecord, StateDir

EXIT_STOPPED, EXIT_NOT_RUNNING, EXIT_TIMEOUT, EXIT_DENIED = 0, 1, 2, 3
CREATE_TIME_SLACK = 0.05


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rackplane-agent stop",
        description="Stop the node agent of one state directory (its runs keep running).",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the agent's state directory (default: $RACKPLANE_AGENT_STATE_DIR, else "
        "/var/lib/rackplane-agent)",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument("--kill", action="store_true", help="SIGKILL, as a crash would")
    how.add_argument(
        "--power-cut",
        action="store_true",
        help="SIGKILL the agent and every process of its runs, as a power cut would",
    )
    p.add_argument(
        "--timeout", type=float, default=40.0, help="seconds to wait for it to stop (40)"
    )
    return p


def _holder(lock: Path) -> int | None:
    """The pid of the agent holding `lock`, or None when no agent holds it."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held: an agent runs; its pid is in the file
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _kill_runs(state: StateDir) -> list[str]:
    """SIGKILL each recorded run's process group that is still the one it recorded."""
    killed = []
    for run_dir in state.run_dirs():
        try:
            rec = RunRecord.load(run_dir)
        except (OSError, ValueError, TypeError):
            continue
        if rec.pid is None:
            continue
        if rec.create_time is None:
            continue  # it was gone before its start time was read: nothing proves a pid ours
        try:
            proc = psutil.Process(rec.pid)
            if abs(proc.create_time() - rec.create_time) > CREATE_TIME_SLACK:
                continue  # the pid was reused: not this run's
            os.killpg(rec.pid, signal.SIGKILL)
            killed.append(rec.key)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return killed


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    state = StateDir(args.state_dir or default_state_dir())
    lock = state.root / "agent.lock"
    try:
        pid = _holder(lock)
    except PermissionError:
        print(f"rackplane-agent stop: {state.root} is not yours to read (run as its agent's user)")
        return EXIT_DENIED
    if pid is None:
        print(f"rackplane-agent stop: no agent runs on {state.root}")
        if args.power_cut:
            killed = _kill_runs(state)
            print(f"killed {len(killed)} run(s): {', '.join(killed) or 'none running'}")
        return EXIT_NOT_RUNNING
    if pid <= 0:
        print(f"rackplane-agent stop: {lock} is held but names no pid")
        return EXIT_TIMEOUT
    sig = signal.SIGKILL if (args.kill or args.power_cut) else signal.SIGTERM
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        print(f"rackplane-agent stop: agent {pid} is not yours to stop (run as its user)")
        return EXIT_DENIED
    deadline = time.monotonic() + args.timeout
    while _holder(lock) is not None:
        if time.monotonic() > deadline:
            print(f"rackplane-agent stop: agent {pid} still runs after {args.timeout:g} s")
            return EXIT_TIMEOUT
        time.sleep(0.1)
    print(f"stopped agent {pid} ({signal.Signals(sig).name}) of {state.root}")
    if args.power_cut:
        killed = _kill_runs(state)
        print(f"killed {len(killed)} run(s): {', '.join(killed) or 'none running'}")
    return EXIT_STOPPED
