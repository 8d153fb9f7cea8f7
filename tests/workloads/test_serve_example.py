"""`examples/serve.py` (issue 47 §4): the stand-in inference server replicas of an endpoint run.
It speaks OpenAI's `/v1/completions` (whole answers and server-sent events), decodes concurrent
requests in one batch (so a replica has a capacity curve), is ready only after its load time,
and refuses bad requests with OpenAI's error shape."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rackplane_bench.deploy import free_port
from tests.fixtures.harness import ROOT
from tests.fixtures.world import wait_until

SERVE = ROOT / "examples" / "serve.py"


@pytest.fixture(scope="module")
def server():
    port = free_port()
    argv = [sys.executable, str(SERVE), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--token-ms", "20", "--max-batch", "4", "--startup-s", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def answers() -> int | None:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code
        except httpx.HTTPError:
            return None

    first = wait_until(answers, timeout=20)
    yield url, first
    proc.terminate()
    proc.wait(timeout=10)


def test_it_loads_then_completes_streams_batches_and_refuses_bad_requests(server):
    url, first = server
    assert first == 503  # loading: not ready, and says so
    wait_until(lambda: httpx.get(f"{url}/healthz").status_code == 200, timeout=10)

    whole = httpx.post(f"{url}/v1/completions", json={"prompt": "hi there", "max_tokens": 5})
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["text"].split()) == 5
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["batch_max"] == 1

    # Streamed: one event per token as it is made, then the usage, then [DONE].
    events, stamps = [], []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 6, "stream": True}
    ) as r:
        assert r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                stamps.append(time.monotonic())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 6}).json()[
            "choices"
        ][0]["text"]
    )
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert stamps[5] > stamps[0]  # tokens arrive over time, not all at the end

    # Concurrent requests share decode steps, at most --max-batch of them.
    with ThreadPoolExecutor(8) as pool:
        got = list(
            pool.map(
                lambda i: httpx.post(
                    f"{url}/v1/completions",
                    json={"prompt": f"p{i}", "max_tokens": 40},
                    timeout=30,
                ).json(),
                range(8),
            )
        )
    batches = [g["usage"]["batch_max"] for g in got]
    assert max(batches) == 4 and min(batches) >= 2, batches
    metrics = httpx.get(f"{url}/metrics").text
    assert "serve_requests_total 11" in metrics and "serve_sequences_running 0" in metrics

    # Bad requests: OpenAI's error shape, never a crash.
    for bad in (b"{", b'{"max_tokens": 0}', b'{"prompt": 3}', b"[]"):
        r = httpx.post(f"{url}/v1/completions", content=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
    assert httpx.get(f"{url}/nope").status_code == 404
    assert httpx.get(f"{url}/healthz").status_code == 200
