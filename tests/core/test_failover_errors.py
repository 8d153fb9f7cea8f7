"""What a failover looks like to a client is a 503 with Retry-After, never a 500: a write that
reaches a node that just became a replica (SQLSTATE 25006, which SQLAlchemy wraps as an
InternalError), the old leader shutting down (57P01), a reset connection, no master named by
the Sentinels yet. A real bug stays a 500. An idempotent request is run again first, so a
failover shorter than its attempts is never seen; a POST is not (its commit may have landed)."""

from __future__ import annotations

import psycopg
from sqlalchemy.exc import InternalError, OperationalError

from app.core.errors import is_unavailable
from tests.fixtures.world import auth


def test_failover_errors_are_unavailable_and_bugs_are_not():
    ro = psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
    assert is_unavailable(InternalError("INSERT INTO workloads ...", {}, ro))
    down = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert is_unavailable(OperationalError("SELECT 1", {}, down))
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as exc:
            raise RuntimeError("the broker went away") from exc
    except RuntimeError as wrapped:
        assert is_unavailable(wrapped)
    assert not is_unavailable(KeyError("a bug"))
    bad = psycopg.errors.UndefinedColumn('column "nope" does not exist')
    assert not is_unavailable(InternalError("SELECT nope", {}, bad))


def _flaky(monkeypatch, module, name: str, failures: int) -> list[int]:
    """`module.name` raises what a failing-over PostgreSQL raises, `failures` times."""
    real = getattr(module, name)
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= failures:
            raise OperationalError("SELECT ...", {}, psycopg.errors.AdminShutdown("shutdown"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
    return calls


def test_idempotent_requests_run_again_through_a_failover_and_posts_do_not(
    client, world, monkeypatch
):
    from app.api import keys as keys_api

    tenant = world.tenant("retry")
    key = world.key(tenant)
    calls = _flaky(monkeypatch, keys_api, "keys_page", failures=2)
    r = client.get("/v1/keys", headers=auth(key))
    assert r.status_code == 200, r.text
    assert calls[0] == 3 and [k["name"] for k in r.json()["items"]] == ["test"]

    calls = _flaky(monkeypatch, keys_api, "keys_page", failures=5)
    r = client.get("/v1/keys", headers=auth(key))
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["code"] == "dependency_unavailable" and calls[0] == 3  # three attempts

    calls = _flaky(monkeypatch, keys_api, "create_key", failures=1)
    r = client.post("/v1/keys", json={"name": "once"}, headers=auth(key))
    assert r.status_code == 503 and calls[0] == 1, "a POST is not run again by the server"
    r = client.post("/v1/keys", json={"name": "once"}, headers=auth(key))
    assert r.status_code == 201 and calls[0] == 2


def test_a_keyed_post_whose_commit_landed_is_never_applied_again(client, world, monkeypatch):
    """The answer of a committed request lost (here: a failure after its COMMIT, as a
    connection lost during COMMIT looks to the server): the client's retry with the same
    Idempotency-Key is told so, and nothing is applied twice. A request that failed before its
    commit is forgotten: the same key runs it again."""
    from sqlalchemy import func, select

    from app.api import keys as keys_api
    from app.core import routing
    from app.core.db import session_scope
    from app.models.keys import ApiKey

    tenant = world.tenant("ambiguous")
    key = world.key(tenant)
    fail = [True]

    def lost_answer() -> None:
        if fail[0]:
            fail[0] = False
            raise OperationalError("COMMIT", {}, psycopg.errors.AdminShutdown("shutdown"))

    monkeypatch.setattr(routing, "AFTER_COMMIT", [*routing.AFTER_COMMIT, lost_answer])
    headers = {**auth(key), "Idempotency-Key": "ambiguous-1"}
    r = client.post("/v1/keys", json={"name": "once"}, headers=headers)
    assert r.status_code == 503, r.text
    r = client.post("/v1/keys", json={"name": "once"}, headers=headers)
    assert r.status_code == 409 and r.json()["code"] == "idempotency_answer_lost", r.text
    with session_scope() as s:
        made = s.scalar(
            select(func.count())
            .select_from(ApiKey)
            .where(ApiKey.tenant_id == tenant.id, ApiKey.name == "once")
        )
    assert made == 1, "applied once, not again on the retry"

    calls = _flaky(monkeypatch, keys_api, "create_key", failures=1)
    headers = {**auth(key), "Idempotency-Key": "ambiguous-2"}
    assert client.post("/v1/keys", json={"name": "twice"}, headers=headers).status_code == 503
    r = client.post("/v1/keys", json={"name": "twice"}, headers=headers)
    assert r.status_code == 201 and calls[0] == 2, r.text
