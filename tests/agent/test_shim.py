"""The shim: runs argv in its own process group, survives the group's signals, records the
exit atomically and exits the same way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rackplane_agent.runtimes.base import spawn_shim
from tests.agent.helpers import python, wait_until


def _shim(tmp_path, code: str) -> subprocess.Popen:
    return spawn_shim(
        python(code),
        {"PATH": os.environ["PATH"]},
        tmp_path,
        exit_file=tmp_path / "exit.json",
        output=tmp_path / "output.log",
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


def test_child_pythonpath_is_restored(tmp_path):
    p = spawn_shim(
        python("import os; print(repr(os.environ.get('PYTHONPATH')))"),
        {"PATH": os.environ["PATH"]},
        tmp_path,
        exit_file=tmp_path / "exit.json",
        output=tmp_path / "output.log",
    )
    assert p.wait(10) == 0
    assert (tmp_path / "output.log").read_text().strip() == "None"


def test_command_not_found(tmp_path):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rackplane_agent.shim",
            "--exit-file",
            str(tmp_path / "x.json"),
            "--",
            "/nonexistent/binary",
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
