"""Several hosts on one machine: each a network namespace with its own address, joined to the
others by a veth pair on a bridge in the root namespace (Debian's iproute2; needs root).

    hosts = Hosts.make(2)            # hosts.names: ["rp-1a2b-h0", ...], hosts.address(i)
    hosts.popen(0, argv, ...)        # a process inside host 0 (its network, its address)
    hosts.lose(0)                    # host 0 dies: every process in it SIGKILLed, its link cut
    hosts.remove()

The root namespace is reachable from every host at `hosts.gateway` (where the tests' API
listens): a host's agent talks to the control plane over the bridge, and the runs it starts
live in its namespace, so a gang's ranks on two hosts meet across the bridge, as on two
machines. The kernel's bridge netfilter hook is turned off for this bridge only (Docker's
FORWARD policy would otherwise drop what crosses it)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def available() -> str | None:
    """Why namespaced hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (make train-engines)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Hosts:
    tag: str
    subnet: str  # "10.201.17": hosts are .10, .11, ...; the gateway (root namespace) .1
    names: list[str] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"rpb{self.tag}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def veth(self, i: int) -> str:
        return f"rpv{self.tag}{i}"

    @classmethod
    def make(cls, n: int) -> Hosts:
        """`n` hosts on a bridge of their own, in a /24 no interface here uses yet."""
        why = available()
        if why:
            raise RuntimeError(why)
        used = _ip("-4", "-o", "addr").stdout
        for _ in range(50):
            subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250) + 1}"
            if f" {subnet}." not in used:
                break
        hosts = cls(tag=secrets.token_hex(3), subnet=subnet)
        try:
            hosts._build(n)
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def _build(self, n: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        # What crosses the bridge is not filtered by the root namespace's iptables (br_netfilter).
        _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(n):
            ns = f"rp-{self.tag}-h{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            # No name server is reachable from a host: lookups fail at once, not after their
            # timeouts (`ip netns exec` mounts /etc/netns/NAME/resolv.conf over /etc's).
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.gateway)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """`argv` started inside host `i`."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], **kwargs)

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.names[i], check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def lose(self, i: int, *, cut_first: bool = False) -> float:
        """Host `i` dies: every process in it is SIGKILLed (the kernel closes their sockets,
        as a crashed host's peers see a reset) and its link is cut. `cut_first`: the link
        goes first, as in a power cut (its peers' connections hang until they time out).
        Returns the time.time() of the loss."""
        at = time.time()
        if cut_first:
            _ip("link", "set", self.veth(i), "down", check=False)
        for _ in range(5):  # a process forked while the last ones were killed
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        _ip("link", "set", self.veth(i), "down", check=False)
        self.lost.add(i)
        return at

    def restore(self, i: int) -> None:
        """Host `i`'s link is back (its processes are not: start its agent again)."""
        _ip("link", "set", self.veth(i), "up", check=False)
        self.lost.discard(i)

    def remove(self) -> None:
        for i, ns in enumerate(self.names):
            for pid in self.pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("link", "del", self.veth(i), check=False)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self.names = []
