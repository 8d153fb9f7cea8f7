"""A serving run's endpoint on the node (a replica of an inference endpoint): the port the
agent publishes it on, and whether it takes requests yet.

A run whose assignment has `serve` gets one of the node's ports from the agent's
`--serve-ports` range when it starts (`sshports.pick`, the same rules as an SSH port: in turn,
free on the host, held by no live run). A `process` run listens on it itself (its `PORT`); a
container listens on `serve.port` (its `PORT`), which podman publishes from it.

Readiness (`ready`): a GET of the run's `serve.ready_path` on 127.0.0.1:PORT that answers 2xx,
every port tried at once within `timeout`. A server still loading its model answers 503 or
does not listen yet; either is "not yet". Once a run is ready it is reported so and the
gateway routes to it; a replica that stops answering later is the gateway's to notice (it
fails over to another) and the controller's to replace when its run ends."""

from __future__ import annotations

import http.client
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor


def _answers(host: str, port: int, path: str, timeout: float) -> bool:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"User-Agent": "rackplane-agent"})
        return 200 <= conn.getresponse().status < 300
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def ready(
    targets: Iterable[tuple[int, str]], host: str = "127.0.0.1", timeout: float = 0.5
) -> set[int]:
    """The ports among `targets` ((port, path) pairs) whose path answers 2xx, all tried at
    once, each within `timeout` seconds."""
    todo = sorted(set(targets))
    if not todo:
        return set()
    with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
        answers = pool.map(lambda t: _answers(host, t[0], t[1], timeout), todo)
        return {port for (port, _), ok in zip(todo, answers, strict=True) if ok}
