"""An instance's SSH endpoint on the node: the port the agent picks for it, and whether an SSH
server answers there.

A `podman` or `vm` run with SSH keys gets one of the node's ports from the agent's
`--ssh-ports` range when it starts (`pick`): one no live run of this agent holds, that binds on
0.0.0.0 right now (nothing else on the host listens there), taken in turn after the last one
handed out rather than always the lowest, so a port just freed rests a while (netavark can
leave a DNAT rule behind for a moment, and a tenant's client may still be knocking on it). The
runtime forwards that port to the run's SSH server on its port 22: podman's `--publish`, QEMU's
`hostfwd`. Between the check and the runtime's own bind another process may take the port: the
run then fails visibly (podman or QEMU says the address is in use).

Readiness (`banners`): a TCP connection to 127.0.0.1:PORT, on which an SSH server speaks first
(`SSH-2.0-...`, RFC 4253 §4.2). Every port is tried at once and the whole check waits at most
`timeout`: what is not listening yet refuses at once; what accepts and stays silent (podman's
conmon holds the port before the container's DNAT rule exists) is given up at the deadline.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Collection, Iterable

BANNER_BYTES = 255  # an SSH identification line is at most 255 bytes, CR LF included


def bindable(port: int, host: str = "0.0.0.0") -> bool:
    """Whether a TCP listener could take `port` on `host` now (SO_REUSEADDR, as QEMU's and
    podman's own listeners bind: a connection of the port's last user in TIME_WAIT does not
    count, a listener on any address does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick(
    ports: tuple[int, int],
    held: Collection[int],
    after: int | None = None,
    *,
    free=bindable,
) -> int | None:
    """The first port of the range `ports` (first and last included), in turn after `after`,
    that no live run holds (`held`) and that is `free` on the host; None when there is none."""
    first, last = ports
    size = last - first + 1
    start = 0 if after is None or not first <= after <= last else after - first + 1
    for i in range(size):
        port = first + (start + i) % size
        if port not in held and free(port):
            return port
    return None


def banners(ports: Iterable[int], host: str = "127.0.0.1", timeout: float = 0.5) -> set[int]:
    """The ports among `ports` on which an SSH server greets (a line starting `SSH-`), all tried
    at once, within `timeout` seconds in all."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    socks: dict[int, socket.socket] = {}
    got: dict[int, bytes] = {}
    answered: set[int] = set()

    def done(port: int) -> None:
        if any(line.startswith(b"SSH-") for line in got.pop(port, b"").split(b"\n")):
            answered.add(port)
        sock = socks.pop(port)
        sel.unregister(sock)
        sock.close()

    try:
        for port in sorted(set(ports)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            err = sock.connect_ex((host, port))
            if err not in (0, errno.EINPROGRESS):
                sock.close()
                continue
            sel.register(sock, selectors.EVENT_READ, port)
            socks[port], got[port] = sock, b""
        while socks:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                port = key.data
                try:
                    data = socks[port].recv(BANNER_BYTES)
                except BlockingIOError:
                    continue
                except OSError:  # refused, reset: nothing there yet
                    data = b""
                got[port] += data
                if not data or b"\n" in got[port] or len(got[port]) >= BANNER_BYTES:
                    done(port)
    finally:
        for port in list(socks):
            done(port)  # a banner cut short by the deadline still counts
        sel.close()
    return answered
