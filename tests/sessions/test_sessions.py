"""Portal sign-in: an API key traded for an HttpOnly session cookie, CSRF on everything that may
change something, idle and absolute expiry, sign-out, and the key's fate shared."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update
from starlette.websockets import WebSocketDisconnect

from app.core.db import session_scope, utcnow
from app.models.sessions import BrowserSession
from app.tenancy import principals as tenancy_auth
from tests.fixtures.world import CORDONED_H100, auth

ME = "query { viewer { slug } }"


def sign_in(client, key: str) -> dict:
    r = client.post("/v1/sessions", json={"api_key": key})
    assert r.status_code == 201, r.text
    return r.json()


def test_sign_in_sets_an_httponly_strict_cookie_and_keeps_no_key(client, world):
    key = world.key(world.tenant("acme"))
    r = client.post("/v1/sessions", json={"api_key": key})
    assert r.status_code == 201, r.text
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("rp_session=rps_")
    lowered = cookie.lower()
    assert "httponly" in lowered and "samesite=strict" in lowered and "path=/" in lowered
    assert "secure" not in lowered  # plain http here; over TLS it is Secure
    assert r.headers["cache-control"] == "no-store"
    body = r.json()
    assert body["operator"] is False and body["scopes"] == ["admin", "read", "write"]
    assert key not in r.text and key not in cookie
    token = client.cookies["rp_session"]
    with session_scope() as s:
        row = s.scalars(select(BrowserSession)).one()
        assert token not in (row.token_hash, row.user_agent) and len(row.token_hash) == 64
        assert row.tenant_id is not None
        assert abs((row.expires_at - row.created_at).total_seconds() - 43200) < 1
    assert body["csrf_token"] != token and len(body["csrf_token"]) == 64


def test_the_cookie_authenticates_reads_and_csrf_guards_every_write(client, world):
    world.fleet(CORDONED_H100)
    key = world.key(world.tenant("acme"))
    csrf = sign_in(client, key)["csrf_token"]
    assert client.get("/v1/workloads").status_code == 200
    me = client.get("/v1/sessions/current")
    assert me.status_code == 200 and me.json()["csrf_token"] == csrf
    body = {"kind": "instance", "gpus": 1}
    r = client.post("/v1/workloads", json=body)
    assert r.status_code == 403 and r.json()["code"] == "csrf_token_invalid"
    assert r.headers["content-type"].startswith("application/problem+json")
    r = client.post("/v1/workloads", json=body, headers={"X-CSRF-Token": "0" * 64})
    assert r.status_code == 403 and r.json()["code"] == "csrf_token_invalid"
    r = client.post(
        "/v1/workloads", json=body, headers={"X-CSRF-Token": csrf, "Idempotency-Key": "w1"}
    )
    assert r.status_code == 201, r.text
    again = client.post(
        "/v1/workloads", json=body, headers={"X-CSRF-Token": csrf, "Idempotency-Key": "w1"}
    )
    assert again.status_code == 201 and again.json()["id"] == r.json()["id"]  # the tenant's space
    assert client.get("/v1/workloads").json()["items"][0]["id"] == r.json()["id"]
    # GraphQL: every POST is a write as far as CSRF goes.
    r = client.post("/graphql", json={"query": ME})
    assert r.status_code == 403 and r.json()["code"] == "csrf_token_invalid"
    r = client.post("/graphql", json={"query": ME}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and r.json()["data"]["viewer"]["slug"] == "acme"


def test_a_key_header_wins_over_the_cookie(client, world):
    sign_in(client, world.key(world.tenant("acme")))
    other = world.key(world.tenant("other"))
    r = client.post("/graphql", json={"query": ME}, headers=auth(other))  # no CSRF: a key
    assert r.json()["data"]["viewer"]["slug"] == "other"
    bad = client.get("/v1/workloads", headers={"Authorization": "Basic x"})
    assert bad.status_code == 401  # a malformed header is never helped by the cookie


def test_sign_out_ends_the_session_everywhere(client, world):
    csrf = sign_in(client, world.key(world.tenant("acme")))["csrf_token"]
    token = client.cookies["rp_session"]
    r = client.delete("/v1/sessions/current")
    assert r.status_code == 403 and r.json()["code"] == "csrf_token_invalid"  # no forced sign-out
    r = client.delete("/v1/sessions/current", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 204
    assert (
        "rp_session=" in r.headers["set-cookie"] and "max-age=0" in r.headers["set-cookie"].lower()
    )
    assert "rp_session" not in client.cookies
    client.cookies.set("rp_session", token)  # a copy of the old cookie is worth nothing
    r = client.get("/v1/workloads")
    assert r.status_code == 401 and r.json()["code"] == "session_ended"
    assert client.delete("/v1/sessions/current").status_code == 204  # idempotent
    client.cookies.clear()
    r = client.get("/v1/sessions/current")
    assert r.status_code == 401 and r.json()["code"] == "no_session"


def test_revoking_the_key_ends_its_sessions(client, world):
    tenant = world.tenant("acme")
    key = world.key(tenant)
    sign_in(client, key)
    assert client.get("/v1/workloads").status_code == 200
    prefix = key[3:11]
    r = client.get("/v1/keys", headers=auth(key)).json()["items"]
    key_id = next(k["id"] for k in r if k["prefix"] == prefix)
    assert client.delete(f"/v1/keys/{key_id}", headers=auth(key)).status_code == 200
    r = client.get("/v1/workloads")
    assert r.status_code == 401 and r.json()["code"] == "revoked_api_key"


def test_absolute_and_idle_expiry(client, world):
    sign_in(client, world.key(world.tenant("acme")))
    assert client.get("/v1/workloads").status_code == 200
    with session_scope() as s:  # past its absolute end (a watched column: caches drop it)
        s.execute(update(BrowserSession).values(expires_at=utcnow() - timedelta(seconds=1)))
    r = client.get("/v1/workloads")
    assert r.status_code == 401 and r.json()["code"] == "session_expired"

    client.cookies.clear()
    sign_in(client, world.key(world.tenant("beta")))
    assert client.get("/v1/workloads").status_code == 200
    with session_scope() as s:  # unused for longer than the idle time
        s.execute(
            update(BrowserSession)
            .where(BrowserSession.revoked_at.is_(None), BrowserSession.expires_at > utcnow())
            .values(last_seen_at=utcnow() - timedelta(seconds=1801))
        )
    tenancy_auth._cache._invalidate()  # a cached entry carries its own idle end
    r = client.get("/v1/workloads")
    assert r.status_code == 401 and r.json()["code"] == "session_expired"


def test_use_keeps_an_idle_session_alive(client, world):
    sign_in(client, world.key(world.tenant("acme")))
    with session_scope() as s:
        s.execute(update(BrowserSession).values(last_seen_at=utcnow() - timedelta(seconds=1700)))
    tenancy_auth._cache._invalidate()
    assert client.get("/v1/workloads").status_code == 200
    with session_scope() as s:
        seen = s.scalar(select(BrowserSession.last_seen_at))
    assert utcnow() - seen < timedelta(seconds=30)


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"api_key": "rp_short"}, 401, "invalid_api_key"),
        ({"api_key": "rp_" + "a" * 48}, 401, "invalid_api_key"),
        ({}, 422, "validation_error"),
        ({"api_key": "x" * 500}, 422, "validation_error"),
        ({"api_key": "rp_" + "a" * 48, "remember": True}, 422, "validation_error"),
    ],
)
def test_a_bad_sign_in_is_refused_without_a_cookie(client, body, status, code):
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == status and r.json()["code"] == code, r.text
    assert "set-cookie" not in r.headers
    with session_scope() as s:
        assert s.scalar(select(BrowserSession)) is None


def test_forged_and_foreign_cookies_are_refused(client):
    for token in ("rps_" + "x" * 43, "nonsense", "rps_" + "y" * 300):
        client.cookies.set("rp_session", token)
        r = client.get("/v1/workloads")
        assert r.status_code == 401 and r.json()["code"] == "invalid_session"


def test_operators_sign_in_with_platform_keys(client, world):
    body = sign_in(client, world.key())
    assert body["operator"] is True and body["tenant_id"] is None
    assert client.get("/v1/admin/tenants").status_code == 200


def _ws(client, headers):
    return client.websocket_connect(
        "/graphql", subprotocols=["graphql-transport-ws"], headers=headers
    )


@pytest.mark.parametrize("origin", ["http://testserver", None])
def test_a_websocket_takes_the_cookie_only_from_the_portals_origin(client, world, origin):
    sign_in(client, world.key(world.tenant("acme")))
    headers = {"cookie": f"rp_session={client.cookies['rp_session']}"}
    if origin:
        headers["origin"] = origin
    with _ws(client, headers) as ws:
        ws.send_json({"type": "connection_init", "payload": {}})
        assert ws.receive_json()["type"] == "connection_ack"
        ws.send_json({"id": "1", "type": "subscribe", "payload": {"query": ME}})
        msg = ws.receive_json()
    if origin:
        assert msg["type"] == "next" and msg["payload"]["data"]["viewer"]["slug"] == "acme"
    else:  # a cookie without a page behind it
        assert msg["payload"]["errors"][0]["extensions"]["code"] == "cross_origin_websocket", msg


def test_another_sites_page_cannot_open_a_websocket(client, world):
    sign_in(client, world.key(world.tenant("acme")))
    headers = {
        "cookie": f"rp_session={client.cookies['rp_session']}",
        "origin": "https://evil.example",
    }
    with pytest.raises(WebSocketDisconnect) as e:
        with _ws(client, headers):
            pass
    assert e.value.code == 1008  # refused at the handshake
