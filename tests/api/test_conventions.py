"""REST conventions every route follows: problem+json, size limits, idempotency, request ids,
health, readiness and metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tests.fixtures.world import auth


def _tenant_body(slug: str) -> dict:
    return {"name": slug, "slug": slug, "contact_email": f"{slug}@example.com"}


def test_unknown_route_and_method_are_problems(client):
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "not_found" and r.json()["status"] == 404
    r = client.put("/healthz")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


def test_malformed_json_is_a_422_problem(client, world):
    r = client.post(
        "/v1/admin/tenants",
        headers={**auth(world.key(None)), "content-type": "application/json"},
        content="{not json",
    )
    assert r.status_code == 422 and r.json()["code"] == "validation_error"


def test_oversized_bodies_are_413(client, world):
    op = world.key(None)
    big = json.dumps({**_tenant_body("big"), "name": "x" * 2_000_000})
    r = client.post(
        "/v1/admin/tenants", headers={**auth(op), "content-type": "application/json"}, content=big
    )
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"

    def chunks():  # no Content-Length: the limit is enforced while streaming
        for _ in range(40):
            yield b"x" * 65536

    r = client.post(
        "/v1/admin/tenants",
        headers={**auth(op), "content-type": "application/json"},
        content=chunks(),
    )
    assert r.status_code == 413
    # The fleet import route has its own, larger limit.
    r = client.post(
        "/v1/admin/fleet:import",
        headers={**auth(op), "content-type": "application/yaml"},
        content="# " + "x" * 1_500_000 + "\nregions: [{name: r, racks: []}]",
        params={"dry_run": True},
    )
    assert r.status_code == 200, r.text


def test_request_id_is_returned_and_accepted(client):
    r = client.get("/healthz")
    assert len(r.headers["x-request-id"]) == 32
    r = client.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = client.get("/healthz", headers={"X-Request-ID": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"


def test_health_ready_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready", "database": "ok", "broker": "ok"}
    client.get("/v1/nope")
    text = client.get("/metrics").text
    assert 'rackplane_http_requests_total{method="GET",route="/healthz",status="200"}' in text


def test_readyz_reports_an_unreachable_broker_as_503(client, monkeypatch):
    from app.core.config import get_settings

    monkeypatch.setattr(get_settings(), "redis_url", "redis://127.0.0.1:1/0")
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["code"] == "not_ready" and r.json()["checks"] == {"broker": "unreachable"}
    # The driver's error (host, port) stays in the logs.
    assert "127.0.0.1" not in r.text and ":1" not in r.text


def test_idempotent_create_replays_and_detects_reuse(client, world, session):
    from sqlalchemy import func, select

    from app.models.tenants import Tenant

    op = world.key(None)
    headers = {**auth(op), "Idempotency-Key": "create-acme-1"}
    first = client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("acme"))
    second = client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("acme"))
    assert first.status_code == second.status_code == 201
    assert first.json() == second.json()
    assert second.headers.get("idempotent-replayed") == "true"
    assert session.scalar(select(func.count()).select_from(Tenant)) == 1
    other = client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("other"))
    assert other.status_code == 409 and other.json()["code"] == "idempotency_key_reused"
    # Records are per API key (issue 45 item 17): another operator key sending the same
    # Idempotency-Key makes its own request.
    op2 = world.key(None, name="second")
    r = client.post(
        "/v1/admin/tenants",
        headers={**auth(op2), "Idempotency-Key": "create-acme-1"},
        json=_tenant_body("acme-2"),
    )
    assert r.status_code == 201 and r.json()["slug"] == "acme-2", r.text


def test_failed_requests_are_not_remembered(client, world):
    op = world.key(None)
    headers = {**auth(op), "Idempotency-Key": "k-1"}
    bad = client.post(
        "/v1/admin/tenants", headers=headers, json={**_tenant_body("acme"), "slug": "BAD"}
    )
    assert bad.status_code == 422
    good = client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("acme"))
    assert good.status_code == 201


def test_concurrent_requests_with_one_key_create_one_object(client, world, session):
    from sqlalchemy import func, select

    from app.models.tenants import Tenant

    op = world.key(None)
    headers = {**auth(op), "Idempotency-Key": "race-1"}

    def send(_):
        return client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("racer"))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(16)))
    codes = sorted(r.status_code for r in results)
    assert set(codes) <= {201, 409}, codes
    assert session.scalar(select(func.count()).select_from(Tenant)) == 1
    ids = {r.json()["id"] for r in results if r.status_code == 201}
    assert len(ids) == 1
    for r in results:
        if r.status_code == 409:
            assert r.json()["code"] == "idempotency_request_in_progress"


def test_idempotency_records_expire(client, world, session, monkeypatch):
    from datetime import timedelta

    from sqlalchemy import update

    from app.core.db import utcnow
    from app.idempotency.tasks import purge
    from app.models.idempotency import IdempotencyRecord

    op = world.key(None)
    headers = {**auth(op), "Idempotency-Key": "old"}
    assert (
        client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("a1")).status_code
        == 201
    )
    session.execute(update(IdempotencyRecord).values(created_at=utcnow() - timedelta(hours=25)))
    session.commit()
    assert purge() == 1
    # The key is free again: a new body is a new request, not a 409.
    assert (
        client.post("/v1/admin/tenants", headers=headers, json=_tenant_body("a2")).status_code
        == 201
    )


def test_requests_beyond_the_in_flight_bound_wait_then_get_a_503_problem():
    """The bound keeps a burst from deadlocking the database pool: requests past it wait on
    the event loop, and one that waits too long is shed with 503 and Retry-After; probes are
    never queued."""
    import anyio

    from app.core.middleware import ConcurrencyLimitMiddleware

    release = anyio.Event()
    inside = []

    async def app(scope, receive, send):
        inside.append(scope["path"])
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limited = ConcurrencyLimitMiddleware(app, limit=1, timeout=0.2, exempt=frozenset({"/healthz"}))

    async def call(path):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        await limited({"type": "http", "path": path, "method": "GET"}, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    async def scenario():
        results = {}
        async with anyio.create_task_group() as tg:

            async def run(name, path):
                results[name] = await call(path)

            tg.start_soon(run, "slow", "/slow")
            await anyio.sleep(0.05)
            tg.start_soon(run, "shed", "/x")  # waits 0.2 s for the slot, then 503
            tg.start_soon(run, "probe", "/healthz")  # not queued
            await anyio.sleep(0.4)
            tg.start_soon(run, "queued", "/y")  # waits, and gets in once /slow is done
            await anyio.sleep(0.05)
            release.set()
        return results

    results = anyio.run(scenario)
    status, headers, body = results["shed"]
    assert status == 503 and headers[b"retry-after"] == b"1"
    assert headers[b"content-type"] == b"application/problem+json"
    assert json.loads(body)["code"] == "overloaded"
    assert results["probe"][0] == 200 and results["slow"][0] == 200
    assert results["queued"][0] == 200
    assert inside == ["/slow", "/healthz", "/y"]  # the shed request never reached the app


def test_a_body_that_is_not_json_says_where(client, world):
    key = world.key(world.tenant("acme"))
    r = client.post(
        "/v1/workloads",
        content=b'{\n  "kind": "instance",\n  "gpus": 1,,\n}',
        headers={**auth(key), "Content-Type": "application/json"},
    )
    assert r.status_code == 422
    [error] = r.json()["errors"]
    assert (error["field"], error["line"], error["column"]) == ("body", 3, 13)
    assert error["message"].startswith("invalid JSON at line 3, column 13")


def test_the_tests_never_read_a_checkouts_env_file(tmp_path):
    """Issue 45 item 10: the README suggests `.env` for settings, and a user's `.env` broke
    two upgrade tests. The tests' processes read none (RACKPLANE_ENV_FILE=""); anyone else
    reads `.env` in the directory they start from."""
    import os
    import subprocess
    import sys

    from tests.fixtures.harness import ROOT

    (tmp_path / ".env").write_text("RACKPLANE_PORT=1234\n")
    probe = "from app.core.config import get_settings; print(get_settings().api_port)"

    def port(env: dict) -> str:
        env = {**env, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert os.environ["RACKPLANE_ENV_FILE"] == ""
    assert port(dict(os.environ)) == "8000"
    assert port({k: v for k, v in os.environ.items() if k != "RACKPLANE_ENV_FILE"}) == "1234"


def test_make_ha_takes_another_base_port():
    """Issue 45 item 16: `make ha` could only use ports from 15400."""
    import subprocess

    from tests.fixtures.harness import ROOT

    dry = subprocess.run(
        ["make", "-n", "ha", "HA_BASE_PORT=16400"], cwd=ROOT, capture_output=True, text=True
    )
    assert "rackplane_bench.ha up --dir .ha --base-port 16400" in dry.stdout, dry.stdout
