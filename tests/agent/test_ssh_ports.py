"""An instance's SSH endpoint, as the agent keeps it: the port it picks from `--ssh-ports` for a
`podman` or `vm` run with SSH keys, and the readiness it reports once an SSH server greets there.

Through the runner, with a stand-in `vm` runtime whose run is a small Python server on the port
the agent gave it (greeting `SSH-2.0-...` after a delay, or something else): no QEMU, no podman.
The real ones are in test_container_wall.py and test_vm.py.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from rackplane_agent import cli, logfmt, sshports
from rackplane_agent.config import AgentConfig, parse_port_range
from rackplane_agent.runtimes.base import RunPlace, ShimRuntime, base_env, spawn_shim
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE, RunRecord
from rackplane_wire import Assignment
from tests.fixtures.agent import PY, FakeClient, agent, assignment, assignments, step_until

pytestmark = pytest.mark.no_db

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice"
RUNS = [f"00000000-0000-4000-8000-0000000005{i:02d}" for i in range(8)]

# The stand-in's run: after DELAY seconds, listens on PORT and greets each connection.
SERVER = r"""
import socket, sys, time
port, delay, greeting = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(delay)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen(16)
print("listening", port, flush=True)
while True:
    c, _ = s.accept()
    if greeting != "-":
        c.sendall(greeting.encode() + b"\r\n")
        c.close()
"""


class StandInRuntime(ShimRuntime):
    """A `vm` runtime whose run serves the SSH port it was given (its command: delay and
    greeting; `-` accepts and says nothing)."""

    name = "vm"
    own_uid = False
    serves_ssh = True

    def __init__(self) -> None:
        self.given: list[int | None] = []  # the ssh_port each start got

    def check(self, assignment: Assignment) -> None:
        pass

    def launch(
        self,
        assignment: Assignment,
        env: dict[str, str],
        run_dir: Path,
        place: RunPlace,
        rec: RunRecord,
    ) -> subprocess.Popen:
        self.given.append(assignment.ssh_port)
        delay, greeting = (assignment.command + ["0", "SSH-2.0-standin"])[:2]
        argv = [PY, "-c", SERVER, str(assignment.ssh_port or 0), delay, greeting]
        if assignment.ssh_port is None:
            argv = [PY, "-c", "import time; time.sleep(60)"]
        return spawn_shim(
            argv,
            env,
            run_dir,
            exit_file=run_dir / EXIT_FILE,
            output=run_dir / OUTPUT_FILE,
            host_env=base_env(),
            cwd=place.workdir,
        )


def _free_range(size: int) -> tuple[int, int]:
    """`size` consecutive ports free on this host, above the usual ones."""
    for first in range(47_000, 60_000, size + 7):
        if all(sshports.bindable(p) for p in range(first, first + size)):
            return first, first + size - 1
    raise AssertionError(f"no {size} free consecutive ports")


def _agent(state_dir: Path, client: FakeClient, ports: tuple[int, int]):
    a = agent(state_dir, client, work_dir=state_dir.parent / "work", ssh_ports=ports)
    runtime = StandInRuntime()
    a._runtimes["vm"] = runtime
    a._runtime_names.append("vm")
    return a, runtime


def _vm(i: int, delay: str = "0", greeting: str = "SSH-2.0-standin", **kw) -> Assignment:
    kw.setdefault("ssh_keys", [KEY])
    return assignment(RUNS[i], [delay, greeting], runtime="vm", image="img", grace_s=1.0, **kw)


class Listener:
    """A port taken on the host by someone else."""

    def __init__(self, port: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAITs
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(1)

    def close(self) -> None:
        self.sock.close()


# --- the pieces ---------------------------------------------------------------------------------


def test_pick_goes_in_turn_past_held_and_busy_ports():
    busy = {10}
    free = lambda p: p not in busy  # noqa: E731
    assert sshports.pick((10, 14), set(), None, free=free) == 11  # the lowest free first
    assert sshports.pick((10, 14), {11}, 11, free=free) == 12  # after the last one handed out
    assert sshports.pick((10, 14), {12, 13}, 14, free=free) == 11  # round, past busy 10
    assert sshports.pick((10, 14), set(), 99, free=free) == 11  # a last one outside the range
    assert sshports.pick((10, 14), {11, 12, 13, 14}, 12, free=free) is None
    assert sshports.pick((7, 7), set(), 7, free=free) == 7


def test_bindable_sees_a_listener_on_any_address():
    first, _ = _free_range(1)
    assert sshports.bindable(first)
    taken = Listener(first)
    try:
        assert not sshports.bindable(first)
    finally:
        taken.close()
    assert sshports.bindable(first)


def test_banners_are_read_from_every_port_at_once_within_the_timeout():
    first, last = _free_range(6)
    ports = list(range(first, last + 1))
    # first: greets; +1: says something else; +2..+4: accept and say nothing; +5: nobody.
    servers = []

    def serve(port: int, greeting: bytes | None) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(4)
        servers.append(s)

        def loop() -> None:
            while True:
                try:
                    c, _ = s.accept()
                except OSError:
                    return
                if greeting is not None:
                    c.sendall(greeting)
                    c.close()
                else:
                    servers.append(c)  # held open, silent

        threading.Thread(target=loop, daemon=True).start()

    serve(ports[0], b"SSH-2.0-dropbear_2022.83\r\n")
    serve(ports[1], b"HTTP/1.0 400 Bad Request\r\n")
    for p in ports[2:5]:
        serve(p, None)
    try:
        t0 = time.monotonic()
        got = sshports.banners(ports, timeout=0.5)
        took = time.monotonic() - t0
        assert got == {ports[0]}
        assert took < 0.9, took  # three silent ones cost one timeout, not three
        t0 = time.monotonic()
        assert sshports.banners([ports[5]], timeout=0.5) == set()
        assert time.monotonic() - t0 < 0.2  # refused at once
    finally:
        for s in servers:
            s.close()


def test_the_port_range_is_validated(capsys, monkeypatch):
    assert parse_port_range("22000-22999") == (22000, 22999)
    assert parse_port_range("2222-2222") == (2222, 2222)
    for bad in ("22000", "a-b", "0-10", "10-9", "60000-70000", "-5"):
        with pytest.raises(ValueError):
            parse_port_range(bad)
    assert AgentConfig(api="http://x", state_dir=Path("/tmp/x")).ssh_ports == (22000, 22999)
    with pytest.raises(ValueError, match="within 1-65535"):
        AgentConfig(api="http://x", state_dir=Path("/tmp/x"), ssh_ports=(5, 70_000))
    monkeypatch.setattr(logfmt, "setup", lambda *a, **kw: None)  # the tests' logging stays
    assert cli.main(["--api", "http://x", "--ssh-ports", "9-1"]) == 2
    assert "--ssh-ports" in capsys.readouterr().out


# --- through the runner -------------------------------------------------------------------------


def test_a_run_with_keys_gets_a_port_in_turn_and_is_reported_ready_once_ssh_greets(state_dir):
    ports = _free_range(4)
    lo = ports[0]
    client = FakeClient()
    a, runtime = _agent(state_dir, client, ports)
    taken = Listener(lo)  # someone else's on the host
    try:
        # A: skips the busy port; its server greets after half a second.
        first = _vm(0, delay="0.5")
        a.set_assignments(assignments(first))
        step_until(a, lambda: (r := client.last(RUNS[0])) and r.state == "running")
        r = client.last(RUNS[0])
        assert (r.ssh_port, r.ssh_ready) == (lo + 1, False) and runtime.given == [lo + 1]
        assert a.runs[f"{RUNS[0]}.0.0"].ssh_port == lo + 1
        # B: answers, but no SSH; C: no keys, so no port, whatever the assignment said.
        other = _vm(1, greeting="HTTP/1.0 400 Bad Request")
        plain = _vm(2, ssh_keys=[], ssh_port=lo + 3)
        a.set_assignments(assignments(first, other, plain, index=2))
        step_until(a, lambda: (r := client.last(RUNS[0])) and r.ssh_ready, timeout=10)
        assert client.last(RUNS[0]).ssh_port == lo + 1
        assert client.last(RUNS[1]).ssh_port == lo + 2  # in turn after A's
        assert client.last(RUNS[2]).ssh_port is None and runtime.given[2] is None
        time.sleep(1.2)  # B's server has been knocked on a few times
        a.step()
        b = a.runs[f"{RUNS[1]}.0.0"]
        assert not b.ssh_ready and not client.last(RUNS[1]).ssh_ready
        # A ends: its port is free again, yet the next run goes on in turn (lo + 3), and the
        # one after it comes round past the busy port to A's.
        a.set_assignments(assignments(first.model_copy(update={"desired": "stop"}), other, index=3))
        step_until(a, lambda: (r := client.last(RUNS[0])) and r.state == "exited")
        ended = client.last(RUNS[0])
        assert (ended.ssh_port, ended.ssh_ready) == (None, False)  # no endpoint once ended
        a.set_assignments(assignments(other, _vm(3), index=4))
        step_until(a, lambda: (r := client.last(RUNS[3])) and r.state == "running")
        assert client.last(RUNS[3]).ssh_port == lo + 3
        a.set_assignments(assignments(other, _vm(3), _vm(4), index=5))
        step_until(a, lambda: (r := client.last(RUNS[4])) and r.state == "running")
        assert client.last(RUNS[4]).ssh_port == lo + 1
        assert runtime.given == [lo + 1, lo + 2, None, lo + 3, lo + 1]
    finally:
        taken.close()
        a.close()


def test_no_free_port_fails_the_start_with_the_reason(state_dir):
    ports = _free_range(2)
    client = FakeClient()
    a, runtime = _agent(state_dir, client, ports)
    taken = Listener(ports[0])
    try:
        a.set_assignments(assignments(_vm(0)))
        step_until(a, lambda: (r := client.last(RUNS[0])) and r.state == "running")
        assert client.last(RUNS[0]).ssh_port == ports[1]
        a.set_assignments(assignments(_vm(0), _vm(1), index=2))
        step_until(a, lambda: client.last(RUNS[1]) is not None)
        r = client.last(RUNS[1])
        assert r.state == "failed_to_start" and r.ssh_port is None, r
        assert f"no free SSH port on this node: each of {ports[0]}-{ports[1]}" in r.message
        assert runtime.given == [ports[1]]  # the second never reached the runtime
    finally:
        taken.close()
        a.close()


def test_a_port_a_runtime_forwards_is_not_handed_out(state_dir):
    """A port caught by a runtime's plumbing (netavark's DNAT rule left behind by a container
    gone) is skipped, though nothing listens on it."""
    ports = _free_range(3)
    client = FakeClient()
    a, runtime = _agent(state_dir, client, ports)
    runtime.forwarded_ports = lambda: {ports[0], ports[0] + 1}  # type: ignore[method-assign]
    try:
        a.set_assignments(assignments(_vm(0)))
        step_until(a, lambda: (r := client.last(RUNS[0])) and r.state == "running")
        assert client.last(RUNS[0]).ssh_port == ports[0] + 2
    finally:
        a.close()


def test_an_agent_restarted_keeps_each_runs_port_and_goes_on_in_turn(state_dir):
    ports = _free_range(4)
    client = FakeClient()
    a, _ = _agent(state_dir, client, ports)
    a.set_assignments(assignments(_vm(0), _vm(1, delay="30")))
    step_until(a, lambda: (r := client.last(RUNS[0])) and r.ssh_ready, timeout=10)
    assert [client.last(w).ssh_port for w in RUNS[:2]] == [ports[0], ports[0] + 1]
    a.close()  # the runs run on

    client2 = FakeClient()
    b, runtime = _agent(state_dir, client2, ports)
    adopted = b.runs[f"{RUNS[0]}.0.0"]
    assert (adopted.state, adopted.ssh_port, adopted.ssh_ready) == ("running", ports[0], True)
    b.set_assignments(assignments(_vm(0), _vm(1, delay="30"), _vm(2), index=2))
    step_until(b, lambda: (r := client2.last(RUNS[2])) and r.ssh_ready, timeout=10)
    got = {w: client2.last(w) for w in RUNS[:3]}
    assert (got[RUNS[0]].ssh_port, got[RUNS[0]].ssh_ready) == (ports[0], True)
    assert (got[RUNS[1]].ssh_port, got[RUNS[1]].ssh_ready) == (ports[0] + 1, False)
    # The new run: after the last port handed out before the restart, not the lowest free one.
    assert got[RUNS[2]].ssh_port == ports[0] + 2 and runtime.given == [ports[0] + 2]
    b.close()
