"""A serving run (an inference endpoint's replica) on the agent: it gets a port of the node
from `--serve-ports` as its `PORT`, and is reported ready only once its readiness path answers
2xx (examples/serve.py answers 503 while it "loads its model")."""

from __future__ import annotations

import time

import httpx
import pytest

from rackplane_agent import sshports
from rackplane_wire import Serve
from tests.fixtures.agent import PY, FakeClient, agent, assignment, assignments, step_until
from tests.fixtures.harness import ROOT

pytestmark = pytest.mark.no_db

W1, W2 = (f"00000000-0000-4000-8000-00000000005{i}" for i in (1, 2))
SERVE = [PY, str(ROOT / "examples" / "serve.py"), "--host", "127.0.0.1", "--token-ms", "1"]


def _free_range(size: int = 4) -> tuple[int, int]:
    for first in range(41000, 48000, size):
        if all(sshports.bindable(p) for p in range(first, first + size)):
            return first, first + size - 1
    raise AssertionError("no free port range")


def test_a_serving_run_gets_a_port_and_is_ready_only_once_it_answers(state_dir):
    client = FakeClient()
    ports = _free_range()
    a = agent(state_dir, client, serve_ports=ports)
    serve = Serve(port=8000, ready_path="/healthz")
    slow = assignment(W1, [*SERVE, "--startup-s", "1.5"], serve=serve)
    quick = assignment(W2, SERVE, serve=serve)
    a.set_assignments(assignments(slow, quick))
    began = time.monotonic()
    a.step()
    first = client.last(W1)
    assert first.state == "running" and first.serve_ready is False
    assert ports[0] <= first.serve_port <= ports[1]
    other = client.last(W2).serve_port
    assert other != first.serve_port and ports[0] <= other <= ports[1]

    step_until(a, lambda: (r := client.last(W2)) and r.serve_ready, timeout=15)
    # Loading: it listens and answers 503, so it is not ready yet.
    assert client.last(W1).serve_ready is False
    assert httpx.get(f"http://127.0.0.1:{first.serve_port}/healthz").status_code == 503
    step_until(a, lambda: (r := client.last(W1)) and r.serve_ready, timeout=15)
    assert time.monotonic() - began >= 1.5
    # It is the replica's own server on the port it was given (its PORT).
    models = httpx.get(f"http://127.0.0.1:{first.serve_port}/v1/models").json()
    assert models["data"][0]["id"] == "rackplane-stand-in"
    # Ended: the port is no longer reported.
    a.set_assignments(assignments(slow.model_copy(update={"desired": "stop", "grace_s": 2.0})))
    ended = step_until(a, lambda: (r := client.last(W1)) and r.state == "exited" and r)
    assert ended.serve_port is None and ended.serve_ready is False
    a.close()
