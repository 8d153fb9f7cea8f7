"""The shim in front of every run: `python -m rackplane_agent.shim --exit-file F -- argv...`.

The agent starts it as the leader of a new session and process group, with stdout and stderr
already on the run's output.log. It runs argv as a child in the same process group, so the
agent's signals to the group reach the child; its own handlers for those signals (Python
handlers, not SIG_IGN, which the child would inherit through exec) keep it alive to see the
child end. Then it writes the exit atomically as JSON
`{"exit_code": int|null, "signal": "SIGTERM"|null, "at": iso}` and exits the same way.

The record outlives the agent: an agent restarted later reads it (the shim is nobody's pipe).
Only the standard library is used, and nothing of the agent is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from datetime import datetime

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Re-raised on the shim itself when they killed the child; others (core dumps) become 128+n.
_RERAISE = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
_RERAISE |= {signal.SIGKILL, signal.SIGPIPE, signal.SIGALRM}


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


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rackplane_agent.shim")
    p.add_argument("--exit-file", required=True)
    p.add_argument("--cgroup", help="a cgroup v2 directory to join before starting the child")
    p.add_argument(
        "--pythonpath",
        help="the PYTHONPATH the child gets ('' : none); the agent may have set another one "
        "so that this module could be found",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    if not args.argv:
        p.error("no command after --")
    return args


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
    if args.pythonpath is not None:
        if args.pythonpath:
            os.environ["PYTHONPATH"] = args.pythonpath
        else:
            os.environ.pop("PYTHONPATH", None)
    try:
        child = subprocess.Popen(args.argv, restore_signals=True)
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        print(f"rackplane-shim: cannot run {args.argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        write_exit(args.exit_file, code, None)
        return code
    rc = child.wait()  # a signal to the group runs _noted; waitpid resumes (PEP 475)
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
