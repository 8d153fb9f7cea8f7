"""The shim: runs argv in its own process group, survives the group's signals, records the
exit atomically and exits the same way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rackplane_agent.runtimes.base import spawn_shim
from tests.fixtures.agent import python, wait_until

pytestmark = pytest.mark.no_db


def _shim(tmp_path, code: str, **kw) -> subprocess.Popen:
    return spawn_shim(
        python(code),
        {"PATH": os.environ["PATH"]},
        tmp_path,
        exit_file=tmp_path / "exit.json",
        output=tmp_path / "output.log",
        host_env={"PATH": os.environ["PATH"]},
        **kw,
    )


def _exit(tmp_path) -> dict:
    return json.loads((tmp_path / "exit.json").read_text())


def test_exit_zero(tmp_path):
    p = _shim(tmp_path, "print('hello', flush=True)")
    assert p.wait(10) == 0
    record = _exit(tmp_path)
    assert record["exit_code"] == 0 and record["signal"] is None and record["at"]
    assert (tmp_path / "output.log").read_text() == "hello\n"
    assert not list(tmp_path.glob("*.tmp"))  # written by rename


def test_exit_nonzero_and_stderr_in_output(tmp_path):
    p = _shim(tmp_path, "import sys; print('oops', file=sys.stderr); sys.exit(7)")
    assert p.wait(10) == 7
    assert _exit(tmp_path) == {**_exit(tmp_path), "exit_code": 7, "signal": None}
    assert "oops" in (tmp_path / "output.log").read_text()


def test_killed_by_sigterm_to_the_group(tmp_path):
    p = _shim(tmp_path, "import time; print('up', flush=True); time.sleep(30)")
    wait_until(lambda: "up" in (tmp_path / "output.log").read_text())
    assert os.getpgid(p.pid) == p.pid and os.getsid(p.pid) == p.pid  # its own group and session
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(10) == -signal.SIGTERM  # the shim exits as its child did
    assert _exit(tmp_path)["signal"] == "SIGTERM" and _exit(tmp_path)["exit_code"] is None


def test_group_signals_reach_the_child_not_the_shim(tmp_path):
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('usr1', flush=True))\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(0.01)\n"
    )
    p = _shim(tmp_path, code)
    out = tmp_path / "output.log"
    wait_until(lambda: "up" in out.read_text())
    os.killpg(p.pid, signal.SIGUSR1)
    wait_until(lambda: "usr1" in out.read_text())
    assert p.poll() is None  # the shim lives on
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(10) == 5
    assert _exit(tmp_path)["exit_code"] == 5


def test_the_child_gets_its_env_and_the_launch_file_is_gone(tmp_path):
    """The shim finds itself through PYTHONPATH; the child gets exactly its launch's env, and
    the launch file (which holds its secrets) is removed as soon as the shim has read it."""
    code = "import os; print(sorted(os.environ.items()))"
    p = spawn_shim(
        python(code),
        {"PATH": os.environ["PATH"], "SECRET": "s3cret"},
        tmp_path,
        exit_file=tmp_path / "exit.json",
        output=tmp_path / "output.log",
        host_env={"PATH": os.environ["PATH"]},
    )
    assert p.wait(10) == 0
    env = dict(eval((tmp_path / "output.log").read_text()))
    assert env.pop("SECRET") == "s3cret" and "PYTHONPATH" not in env
    assert set(env) <= {"PATH", "LC_CTYPE"}
    assert not (tmp_path / "launch.json").exists()
    assert "s3cret" not in " ".join(psutil.Process().cmdline())


def test_output_is_bounded_and_keeps_the_newest(tmp_path):
    """A run cannot fill the node's disk: past the cap, only the newest 64 KiB are kept."""
    code = (
        "import sys\n"
        "for i in range(20000): sys.stdout.write(f'line {i:06d} ' + 'x' * 90 + '\\n')\n"
        "print('the end')\n"
    )
    p = _shim(tmp_path, code, max_output=256 * 1024)
    assert p.wait(30) == 0
    data = (tmp_path / "output.log").read_bytes()
    assert 256 * 1024 < len(data) < 256 * 1024 + 64 * 1024 + 1024  # 2 MB were written
    assert data.startswith(b"line 000000 ")
    assert b"output past 262144 bytes is not kept" in data
    assert data.rstrip().endswith(b"the end") and b"line 019999 " in data


def test_command_not_found(tmp_path):
    (tmp_path / "launch.json").write_text(json.dumps({"argv": ["/nonexistent/binary"]}))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rackplane_agent.shim",
            "--exit-file",
            str(tmp_path / "x.json"),
            "--launch",
            str(tmp_path / "launch.json"),
        ],
        stderr=subprocess.PIPE,
    )
    _, err = p.communicate(timeout=10)
    assert p.returncode == 127 and b"cannot run" in err
    assert json.loads((tmp_path / "x.json").read_text())["exit_code"] == 127


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGUSR2])
def test_other_forwarded_signals_do_not_kill_the_shim_first(tmp_path, sig):
    code = (
        "import signal, sys, time\n"
        f"signal.signal({int(sig)}, lambda *a: sys.exit(9))\n"
        "print('up', flush=True)\n"
        "time.sleep(30)\n"
    )
    p = _shim(tmp_path, code)
    wait_until(lambda: "up" in (tmp_path / "output.log").read_text())
    time.sleep(0.05)
    os.killpg(p.pid, sig)
    assert p.wait(10) == 9
