"""Inference endpoints end to end (issue 47 §4): a real API, Celery worker (with the
controller's beat tick), node agent and `rackplane gateway` on PostgreSQL, serving
`examples/serve.py` replicas on made-up GPUs.

- An endpoint at zero holds its first request while a replica starts, and serves it; under a
  load ramp it scales to its maximum, and back to zero when the load is gone; only a key of its
  tenant with the `invoke` scope calls it.
- A burst of an endpoint preempts a preemptible training job (which checkpoints in its grace
  and resumes from that step after the burst); a replica killed mid-request gives that request
  a clean 502 and is replaced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from rackplane_bench.deploy import free_port
from tests.fixtures.agent import SYSTEM_PY
from tests.fixtures.nodes import ROOT, Nodes, join_tokens
from tests.fixtures.plane import plane as control_plane
from tests.fixtures.world import auth, wait_until

SERVE = str(ROOT / "examples" / "serve.py")
TRAIN = str(ROOT / "examples" / "train.py")
ALL = ["dedicated-gpu", "shared-timeslice", "shared-fractional", "shared-mig", "vm"]
FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-serve
        kind: hgx
        gpu_model: H100-80GB
        nodes:
          - {name: srv-a, gpus: 4}
"""
ENV = {
    "RACKPLANE_HEARTBEAT_TIMEOUT": "6",
    "RACKPLANE_AGENT_START_TIMEOUT": "60",
    "RACKPLANE_PLACEMENT_TICK": "1",
    "RACKPLANE_ENDPOINT_TICK": "0.5",
    "RACKPLANE_ENDPOINT_STABLE_WINDOW": "8",
    "RACKPLANE_ENDPOINT_PANIC_WINDOW": "2",
    "RACKPLANE_ENDPOINT_SCALE_DOWN_DELAY": "3",
    "RACKPLANE_GATEWAY_HOLD_S": "60",
}


@pytest.fixture(scope="module")
def plane(database, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serving")
    env = {**os.environ, **ENV}
    with control_plane(logs, env, "serving") as url:
        port = free_port()
        gw = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "gateway", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=open(logs / "gateway.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        gateway = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{gateway}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(up, timeout=60)
            yield url, gateway, env
        finally:
            gw.terminate()
            gw.wait(timeout=20)


@pytest.fixture
def node(plane, world, client, tmp_path):
    url, gateway, env = plane
    world.fleet(FLEET)
    op = world.key()
    nodes = Nodes(url, tmp_path, join_tokens(client, op), env)
    nodes.start("srv-a", "127.0.0.21")
    nodes.wait_ready(op)
    yield nodes
    nodes.stop()


def _replica(token_ms: float = 10, startup_s: float = 0.5) -> dict:
    command = [SYSTEM_PY, "-u", SERVE, "--token-ms", str(token_ms), "--max-batch", "8"]
    return {"gpus": 1, "command": [*command, "--startup-s", str(startup_s)]}


def _endpoint(http, key: str, name: str) -> dict:
    r = http.get(f"/v1/endpoints/{name}", headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()


def _ready(http, key: str, name: str) -> int:
    return sum(r["ready"] for r in _endpoint(http, key, name)["replicas"])


def _complete(gateway: str, key: str, name: str, tokens: int, stream: bool = False, **kw):
    return httpx.post(
        f"{gateway}/e/{name}/v1/completions",
        json={"prompt": "the rack serves tokens", "max_tokens": tokens, "stream": stream},
        headers=auth(key),
        timeout=kw.get("timeout", 90),
    )


def test_an_endpoint_scales_from_zero_with_its_load_and_back_for_its_tenant_only(
    plane, node, world
):
    url, gateway, _ = plane
    acme = world.tenant("acme", policy=ALL)
    write = world.key(acme, scopes=("read", "write"))
    invoke = world.key(acme, scopes=("invoke",))
    other = world.key(world.tenant("beta", policy=ALL), scopes=("invoke",))
    http = httpx.Client(base_url=url, timeout=10)
    made = http.post(
        "/v1/endpoints",
        json={
            "name": "chat",
            "replica": _replica(),
            "max_replicas": 3,
            "slo": {"p95_ms": 5000},
            "scaling": {"signal": "concurrency", "target": 2},
        },
        headers=auth(write),
    )
    assert made.status_code == 201, made.text
    assert made.json()["target"] == 0 and made.json()["replicas"] == []

    # Only the tenant's `invoke` keys call it; an invoke key reads nothing on REST.
    models = f"{gateway}/e/chat/v1/models"
    assert httpx.get(models).status_code == 401
    refused = httpx.get(models, headers=auth(write))
    assert refused.status_code == 403 and refused.json()["code"] == "insufficient_scope"
    theirs = httpx.get(models, headers=auth(other))
    assert theirs.status_code == 404 and theirs.json()["code"] == "endpoint_not_found"
    assert httpx.get(f"{gateway}/e/nope/x", headers=auth(invoke)).status_code == 404
    assert http.get("/v1/endpoints", headers=auth(invoke)).status_code == 403

    # From zero: the first request is held while a replica starts, then streamed through.
    began = time.monotonic()
    with httpx.stream(
        "POST",
        f"{gateway}/e/chat/v1/completions",
        json={"prompt": "hello rack", "max_tokens": 5, "stream": True},
        headers=auth(invoke),
        timeout=90,
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    cold = time.monotonic() - began
    # Five tokens, the last chunk with its usage, then [DONE].
    assert events[-1] == "data: [DONE]" and len(events) == 7, events
    assert json.loads(events[0][6:])["choices"][0]["text"]
    ep = _endpoint(http, write, "chat")
    assert ep["target"] == 1 and [r["ready"] for r in ep["replicas"]] == [True]
    log = http.get("/v1/endpoints/chat/events", headers=auth(write)).json()
    assert log[0]["mode"] == "activator" and log[0]["target"] == 1, log

    # A ramp: ten callers at once, each asking again as soon as it is answered. With two
    # requests per replica as the target it scales to its maximum, and nothing fails.
    codes: list[int] = []
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            codes.append(_complete(gateway, invoke, "chat", 40).status_code)

    threads = [threading.Thread(target=caller) for _ in range(10)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: _ready(http, write, "chat") == 3, timeout=60, interval=0.5)
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert _endpoint(http, write, "chat")["target"] == 3

    # Quiet: back to zero after its stable window, every replica's run ended.
    wait_until(
        lambda: (e := _endpoint(http, write, "chat"))["target"] == 0 and not e["replicas"],
        timeout=90,
        interval=0.5,
    )
    log = http.get("/v1/endpoints/chat/events", headers=auth(write)).json()
    scaled = [(e["mode"], e["target"]) for e in reversed(log) if e["kind"] == "scaled"]
    assert scaled[0] == ("activator", 1) and scaled[-1][1] == 0, scaled
    assert max(t for _, t in scaled) == 3 and all("inputs" in e for e in log)
    # What the gateway saw, for Prometheus.
    metrics = httpx.get(f"{gateway}/metrics").text
    eid = made.json()["id"]
    assert f'rackplane_gateway_requests_total{{code="200",endpoint="{eid}"}}' in metrics
    assert cold < 60
    http.close()


def _serving_pids(wid: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            argv = p.info["cmdline"] or []
            if SERVE in argv and "rackplane_agent.shim" not in argv:
                if p.environ().get("RACKPLANE_WORKLOAD_ID") == wid:
                    out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def test_a_burst_preempts_training_and_a_killed_replica_is_replaced(plane, node, world):
    url, gateway, _ = plane
    acme = world.tenant("acme", policy=ALL)
    write = world.key(acme, scopes=("read", "write"))
    invoke = world.key(acme, scopes=("invoke",))
    http = httpx.Client(base_url=url, timeout=10)
    ckpt = node.open / "ckpt"
    ckpt.mkdir()
    ckpt.chmod(0o1777)

    # Preemptible training on every GPU of the node; it checkpoints when asked to stop.
    train = [SYSTEM_PY, "-u", TRAIN, "--steps", "100000", "--step-seconds", "0.05"]
    train += ["--checkpoint-every", "1000000", "--checkpoint-dir", str(ckpt)]
    job = http.post(
        "/v1/workloads",
        json={
            "kind": "instance",
            "gpus": 4,
            "priority": "preemptible",
            "command": train,
            "checkpoint": {"interval_s": 600, "cost_s": 1},
        },
        headers=auth(write),
    )
    assert job.status_code == 201, job.text
    jid = job.json()["id"]
    wait_until(
        lambda: http.get(f"/v1/workloads/{jid}", headers=auth(write)).json()["state"] == "running",
        timeout=90,
    )
    made = http.post(
        "/v1/endpoints",
        json={"name": "burst", "replica": _replica(), "max_replicas": 1},
        headers=auth(write),
    )
    assert made.status_code == 201, made.text

    # The burst: its first request takes a GPU from the training job through preemption.
    first = _complete(gateway, invoke, "burst", 5)
    assert first.status_code == 200, first.text
    events = http.get(f"/v1/workloads/{jid}/events", headers=auth(write)).json()["items"]
    assert any(e["to_state"] == "preempted" for e in events), events

    # A replica killed while it answers: that request gets a clean 502, and the endpoint
    # gets a replica again.
    [replica] = _endpoint(http, write, "burst")["replicas"]
    wid = replica["workload_id"]
    answer: list[httpx.Response] = []
    slow = threading.Thread(
        target=lambda: answer.append(_complete(gateway, invoke, "burst", 600, timeout=60))
    )
    slow.start()

    def decoding() -> bool:  # the request is in the replica's batch
        text = httpx.get(f"http://{replica['host']}:{replica['port']}/metrics").text
        return "serve_sequences_running 1" in text

    wait_until(decoding, timeout=30)
    pids = _serving_pids(wid)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    slow.join(timeout=60)
    assert answer and answer[0].status_code == 502, answer and answer[0].text
    assert answer[0].headers["content-type"] == "application/problem+json"
    assert answer[0].json()["code"] == "replica_failed" and answer[0].headers["retry-after"]
    again = _complete(gateway, invoke, "burst", 5)
    assert again.status_code == 200, again.text

    # After the burst: the endpoint is deleted, and training resumes from its checkpoint.
    assert http.delete("/v1/endpoints/burst", headers=auth(write)).status_code == 204

    def resumed() -> bool:
        logs = http.get(
            f"/v1/workloads/{jid}/logs", params={"limit": 1000}, headers=auth(write)
        ).json()["items"]
        return "resumed from step" in "".join(c["data"] for c in logs)

    wait_until(resumed, timeout=120, interval=1)
    http.close()
