"""The HTTP client: retries on what may pass (with backoff and Retry-After), typed errors on what
will not."""

from __future__ import annotations

import json

import httpx
import pytest

from rackplane_agent.client import (
    ApiError,
    Backoff,
    Client,
    CredentialRefused,
    JoinRefused,
    RouteMissing,
    TransientError,
    retry_after_seconds,
    wait_duration,
)
from rackplane_wire import StatusReport
from tests.fixtures.agent import INVENTORY

pytestmark = pytest.mark.no_db


def _problem(status: int, code: str, **headers: str) -> httpx.Response:
    body = {"type": "about:blank", "title": code, "status": status, "detail": code, "code": code}
    return httpx.Response(
        status, json=body, headers={"content-type": "application/problem+json", **headers}
    )


def _client(handler, **kw) -> tuple[Client, list[float]]:
    slept: list[float] = []
    c = Client(
        "http://cp.test",
        "rpn_abc",
        transport=httpx.MockTransport(handler),
        backoff_initial=0.01,
        backoff_max=0.05,
        sleep=slept.append,
        **kw,
    )
    return c, slept


def test_a_503_then_success_is_retried_with_backoff():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return _problem(503, "unavailable")
        return httpx.Response(200, json={"accepted": 0, "stale": 0})

    client, slept = _client(handler)
    ack = client.status(StatusReport(), attempts=5)
    assert ack.accepted == 0 and len(calls) == 3 and len(slept) == 2
    assert all(0 < s <= 0.05 for s in slept)
    assert calls[0].headers["authorization"] == "Bearer rpn_abc"
    assert json.loads(calls[0].content) == {
        "runs": [],
        "burn_in": None,
        "inventory": None,
        "mig_layouts": [],
    }


def test_429_honours_retry_after():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            return _problem(429, "rate_limited", **{"Retry-After": "0.04"})
        return httpx.Response(200, json={"accepted": 1, "stale": 0})

    client, slept = _client(handler)
    client.status(StatusReport(), attempts=3)
    assert slept == [0.04]


def test_connection_errors_are_retried_then_raised():
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    client, slept = _client(handler)
    with pytest.raises(TransientError):
        client.status(StatusReport(), attempts=3)
    assert len(slept) == 2


def test_401_is_fatal_and_typed():
    calls = []

    def handler(request):
        calls.append(request)
        return _problem(401, "invalid_node_credential")

    client, slept = _client(handler)
    with pytest.raises(CredentialRefused) as err:
        client.status(StatusReport(), attempts=5)
    assert err.value.code == "invalid_node_credential" and len(calls) == 1 and slept == []


def test_join_and_its_refusal():
    def handler(request):
        token = json.loads(request.content)["token"]
        assert "authorization" not in request.headers
        if token == "rpj_good":
            return httpx.Response(
                201,
                json={
                    "node_id": "n1",
                    "node_name": "node-1",
                    "credential": "rpn_new",
                    "credential_prefix": "rpn_ne",
                },
            )
        return _problem(401, "invalid_join_token")

    client, _ = _client(handler)
    client.credential = None
    assert client.join("rpj_good")["node_name"] == "node-1"
    assert client.credential == "rpn_new"
    with pytest.raises(JoinRefused):
        client.join("rpj_bad")


def test_404_and_other_4xx():
    def handler(request):
        if request.url.path.endswith("/logs"):
            return _problem(404, "not_found")
        return _problem(422, "validation_error")

    client, _ = _client(handler)
    from rackplane_wire import LogBatch

    with pytest.raises(RouteMissing):
        client.logs(LogBatch(chunks=[]))
    with pytest.raises(ApiError) as err:
        client.put_inventory(INVENTORY)
    assert err.value.status == 422 and not isinstance(err.value, RouteMissing)


def test_assignments_long_poll_parameters():
    seen = {}

    def handler(request):
        seen["params"] = dict(request.url.params)
        seen["timeout"] = request.extensions["timeout"]
        return httpx.Response(
            200, json={"node": "node-1", "index": 7, "assignments": [], "heartbeat_s": 10}
        )

    client, _ = _client(handler)
    got = client.assignments(3, 30)
    assert got.index == 7 and seen["params"] == {"index": "3", "wait": "30s"}
    assert seen["timeout"]["read"] > 30
    client.assignments(3, 0.5)
    assert seen["params"]["wait"] == "500ms"


def test_a_malformed_answer_is_an_api_error():
    client, _ = _client(lambda r: httpx.Response(200, json={"nope": 1}))
    with pytest.raises(ApiError) as err:
        client.status(StatusReport())
    assert err.value.code == "bad_response"


def test_helpers():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert wait_duration(30) == "30s" and wait_duration(1.5) == "1500ms"
    b = Backoff(0.1, 1.0)
    delays = [b.next() for _ in range(6)]
    assert 0.1 <= delays[0] <= 0.2 and delays[-1] == 1.0
    assert b.next(TransientError("x", retry_after=0.3)) == 0.3
    b.reset()
    assert b.next() <= 0.2
