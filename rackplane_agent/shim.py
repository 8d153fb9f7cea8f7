"""The shim in front of every run: `python -m rackplane_agent.shim --exit-file F --launch L`.

The agent starts it as the leader of a new session and process group, with stdout and stderr
already on the run's output.log, in a fixed environment of the agent's choosing (never the
workload's). It reads the launch file (`{"argv", "env", "cwd", "uid", "gid", "env_fd"}`, 0600
in the agent's state directory) and removes it at once, so the run's secrets rest on no disk.
Then it runs argv as a child in the same process group:

- as the run's own uid and its tenant's gid (no supplementary groups, umask 007) when the
  launch names them,
  in the run's working directory, with the launch's `env` as its whole environment;
- or, for a host-side helper such as podman (`env_fd`), as the agent's user with the shim's
  own fixed environment, the workload's env handed to it as `NAME=value` lines on a pipe at
  that fd (`--env-file /dev/fd/N`), so nothing of the customer's env reaches a host process.

The child's stdout and stderr go through a pipe the shim copies into output.log, up to
`--max-output` bytes; past that the shim says so in one line, keeps only the newest 64 KiB and
writes them when the child ends, so a run cannot fill the node's disk.

The shim's own handlers for the group's signals (Python handlers, not SIG_IGN, which the child
would inherit through exec) keep it alive to see the child end. Then it writes the exit
atomically as JSON `{"exit_code": int|null, "signal": "SIGTERM"|null, "at": iso}` and exits
the same way. The record outlives the agent: an agent restarted later reads it (the shim is
nobody's pipe). Only the standard library is used, and nothing of the agent is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from datetime import datetime

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Re-raised on the shim itself when they killed the child; others (core dumps) become 128+n.
_RERAISE = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
_RERAISE |= {signal.SIGKILL, signal.SIGPIPE, signal.SIGALRM}
DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
TAIL_KEPT = 64 * 1024
# After the child ends, output still in the pipe (or held open by a process it left behind)
# is copied for at most this long.
DRAIN_S = 1.0


def _noted(signum, frame) -> None:  # the group's signal: the child has it too
    pass


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def write_exit(path: str, exit_code: int | None, sig: str | None) -> None:
    record = {
        "exit_code": exit_code,
        "signal": sig,
        "at": datetime.now().astimezone().isoformat(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Output:
    """Copies the child's output to fd 1 up to `cap` bytes, then keeps only the newest."""

    def __init__(self, cap: int, fd: int = 1):
        self.cap = cap
        self.fd = fd
        self.written = 0
        self.dropped = 0
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError:
                return  # a full disk: the run goes on without its output
            view = view[n:]

    def feed(self, data: bytes) -> None:
        room = self.cap - self.written
        if room > 0:
            head = data[:room]
            self._write(head)
            self.written += len(head)
            data = data[room:]
            if not data:
                return
            self._write(
                f"\nrackplane-shim: output past {self.cap} bytes is not kept; its newest "
                f"{TAIL_KEPT // 1024} KiB follow when the run ends\n".encode()
            )
        self.dropped += len(data)
        self._tail.append(data)
        self._tail_bytes += len(data)
        while self._tail_bytes - len(self._tail[0]) >= TAIL_KEPT:
            self._tail_bytes -= len(self._tail.popleft())

    def close(self) -> None:
        if not self.dropped:
            return
        tail = b"".join(self._tail)[-TAIL_KEPT:]
        skipped = self.dropped - len(tail)
        self._write(f"\nrackplane-shim: {skipped} bytes not kept; the newest follow\n".encode())
        self._write(tail)


def _pump(read_fd: int, child: subprocess.Popen, out: Output) -> int:
    """Copy the child's output until it ends (and its pipe is drained); its return code."""
    rc: int | None = None
    ended_at = 0.0
    while True:
        if rc is None:
            rc = child.poll()
            if rc is not None:
                ended_at = time.monotonic()
        elif time.monotonic() - ended_at > DRAIN_S:
            break
        ready, _, _ = select.select([read_fd], [], [], 0.1 if rc is None else 0.05)
        if not ready:
            continue
        data = os.read(read_fd, 65536)
        if not data:  # every writer closed
            if rc is None:
                rc = child.wait()  # a signal to the group runs _noted; waitpid resumes
            break
        out.feed(data)
    os.close(read_fd)
    out.close()
    return rc


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rackplane_agent.shim")
    p.add_argument("--exit-file", required=True)
    p.add_argument("--launch", required=True, help="the launch file (read, then removed)")
    p.add_argument("--cgroup", help="a cgroup v2 directory to join before starting the child")
    p.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT)
    return p.parse_args(argv)


def _env_pipe(env: dict[str, str], fd: int) -> None:
    """The env as `NAME=value` lines on a pipe whose read end is `fd` (podman's --env-file)."""
    data = "".join(f"{k}={v}\n" for k, v in env.items()).encode()
    r, w = os.pipe()
    if len(data) > 60_000:  # more than a pipe holds before its reader starts
        raise OSError("the run's environment is too large to hand over")
    os.write(w, data)
    os.close(w)
    if r != fd:
        os.dup2(r, fd, inheritable=True)
        os.close(r)
    else:
        os.set_inheritable(fd, True)


def _read_launch(path: str) -> dict:
    try:
        with open(path) as fh:
            launch = json.load(fh)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return launch


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    for sig in FORWARDED:
        signal.signal(sig, _noted)
    if args.cgroup:
        try:
            with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
        except OSError as exc:
            print(f"rackplane-shim: cannot join cgroup {args.cgroup}: {exc}", file=sys.stderr)
    try:
        launch = _read_launch(args.launch)
        run_argv = [str(a) for a in launch["argv"]]
        env = {str(k): str(v) for k, v in launch.get("env", {}).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"rackplane-shim: cannot read the launch file: {exc}", file=sys.stderr, flush=True)
        write_exit(args.exit_file, 126, None)
        return 126
    uid, gid = launch.get("uid"), launch.get("gid")
    env_fd = launch.get("env_fd")
    kwargs: dict = {}
    if uid is not None:
        kwargs.update(user=int(uid), group=int(gid if gid is not None else uid), extra_groups=[])
    read_fd, write_fd = os.pipe()
    try:
        if env_fd is not None:
            _env_pipe(env, int(env_fd))
            child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            kwargs["pass_fds"] = (int(env_fd),)
        else:
            child_env = env
        child = subprocess.Popen(
            run_argv,
            env=child_env,
            cwd=launch.get("cwd") or None,
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=write_fd,
            umask=int(launch.get("umask", 0o022)),
            restore_signals=True,
            **kwargs,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(read_fd)
        os.close(write_fd)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        what = run_argv[0] if run_argv else "(nothing)"
        print(f"rackplane-shim: cannot run {what!r}: {exc}", file=sys.stderr, flush=True)
        write_exit(args.exit_file, code, None)
        return code
    os.close(write_fd)
    if env_fd is not None:
        os.close(int(env_fd))
    rc = _pump(read_fd, child, Output(args.max_output))
    if rc < 0:
        signum = -rc
        write_exit(args.exit_file, None, signal_name(signum))
        sys.stdout.flush()
        sys.stderr.flush()
        if signum in _RERAISE:
            if signum != signal.SIGKILL:
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return 128 + signum
    write_exit(args.exit_file, rc, None)
    return rc


if __name__ == "__main__":
    sys.exit(main())
