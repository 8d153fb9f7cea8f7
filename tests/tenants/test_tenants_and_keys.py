from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.fixtures.harness import TEST_DB, db_url
from tests.fixtures.world import auth


def test_operator_creates_tenant_with_default_policy(client, world):
    op = world.key(None)
    r = client.post(
        "/v1/admin/tenants",
        headers=auth(op),
        json={"name": "Acme", "slug": "acme", "contact_email": "ops@acme.io"},
    )
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["status"] == "active"
    assert "shared-mig" in t["isolation_policy"] and "confidential-vm" not in t["isolation_policy"]
    again = client.post(
        "/v1/admin/tenants",
        headers=auth(op),
        json={"name": "Acme 2", "slug": "acme", "contact_email": "x@acme.io"},
    )
    assert again.status_code == 409 and again.json()["code"] == "tenant_slug_taken"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"name": "A", "slug": "Bad Slug", "contact_email": "a@b.io"}, "body.slug"),
        ({"name": "A", "slug": "ok", "contact_email": "not-an-email"}, "body.contact_email"),
        (
            {"name": "A", "slug": "ok", "contact_email": "a@b.io", "isolation_policy": ["gold"]},
            "body.isolation_policy[0]",
        ),
        ({"name": "A", "slug": "ok", "contact_email": "a@b.io", "colour": "red"}, "body.colour"),
        (
            {"name": "A", "slug": "ok", "contact_email": "a@b.io", "isolation_policy": []},
            "body.isolation_policy",
        ),
    ],
)
def test_invalid_tenant_bodies_name_the_field(client, world, body, field):
    r = client.post("/v1/admin/tenants", headers=auth(world.key(None)), json=body)
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["code"] == "validation_error"
    assert field in [e["field"] for e in problem["errors"]], problem


def test_signup_is_pending_until_an_operator_approves(client, world):
    r = client.post(
        "/v1/signup", json={"name": "New Co", "slug": "newco", "contact_email": "a@newco.io"}
    )
    assert r.status_code == 201, r.text
    key = r.json()["api_key"]["key"]
    tid = r.json()["tenant"]["id"]
    assert r.json()["tenant"]["status"] == "pending"
    # A pending tenant may see itself, nothing else.
    me = client.get("/v1/tenant", headers=auth(key))
    assert me.status_code == 200 and me.json()["status"] == "pending"
    blocked = client.get("/v1/capacity", headers=auth(key))
    assert blocked.status_code == 403 and blocked.json()["code"] == "tenant_not_active"
    op = world.key(None)
    assert client.post(f"/v1/admin/tenants/{tid}:approve", headers=auth(op)).status_code == 200
    assert client.get("/v1/capacity", headers=auth(key)).status_code == 200
    twice = client.post(f"/v1/admin/tenants/{tid}:approve", headers=auth(op))
    assert twice.status_code == 409 and twice.json()["code"] == "tenant_not_pending"
    # Suspension takes effect on the next request.
    client.patch(f"/v1/admin/tenants/{tid}", headers=auth(op), json={"status": "suspended"})
    assert client.get("/v1/keys", headers=auth(key)).status_code == 403


def test_key_lifecycle_shown_once_hashed_revocable(client, world, session):
    from sqlalchemy import select

    from app.models.keys import ApiKey

    t = world.tenant("acme")
    admin_key = world.key(t, scopes=["admin"])
    r = client.post("/v1/keys", headers=auth(admin_key), json={"name": "ci", "scopes": ["read"]})
    assert r.status_code == 201, r.text
    created = r.json()
    secret = created["key"]
    assert secret.startswith("rp_") and created["prefix"] == secret[3:11]
    # Never shown again.
    listed = client.get("/v1/keys", headers=auth(admin_key)).json()["items"]
    assert all("key" not in k for k in listed) and len(listed) == 2
    assert "key" not in client.get(f"/v1/keys/{created['id']}", headers=auth(admin_key)).json()
    # Stored only as a hash.
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == created["prefix"]))
    assert secret not in row.secret_hash and len(row.secret_hash) == 64
    # Works, is read-only, records last use.
    assert client.get("/v1/tenant", headers=auth(secret)).status_code == 200
    denied = client.post("/v1/keys", headers=auth(secret), json={"name": "x"})
    assert denied.status_code == 403 and denied.json()["code"] == "insufficient_scope"
    used = client.get(f"/v1/keys/{created['id']}", headers=auth(admin_key)).json()
    assert used["last_used_at"] is not None
    # Revocation takes effect on the very next request.
    assert client.delete(f"/v1/keys/{created['id']}", headers=auth(admin_key)).status_code == 200
    r = client.get("/v1/tenant", headers=auth(secret))
    assert r.status_code == 401 and r.json()["code"] == "revoked_api_key"


def test_expired_key_is_rejected(client, world, session):
    from datetime import timedelta

    from sqlalchemy import update

    from app.core.db import utcnow
    from app.models.keys import ApiKey

    t = world.tenant("acme")
    key = world.key(t)
    session.execute(
        update(ApiKey)
        .where(ApiKey.prefix == key[3:11])
        .values(expires_at=utcnow() - timedelta(seconds=1))
    )
    session.commit()
    r = client.get("/v1/tenant", headers=auth(key))
    assert r.status_code == 401 and r.json()["code"] == "expired_api_key"


def test_platform_key_cannot_use_tenant_routes(client, world):
    r = client.get("/v1/capacity", headers=auth(world.key(None)))
    assert r.status_code == 403 and r.json()["code"] == "tenant_key_required"


@pytest.mark.skipif(shutil.which("pg_dump") is None, reason="pg_dump not installed")
def test_database_dump_contains_no_usable_key(client, world):
    t = world.tenant("acme")
    keys = [world.key(t), world.key(None)]
    r = client.post(
        "/v1/signup", json={"name": "S", "slug": "signup-co", "contact_email": "s@s.io"}
    )
    keys.append(r.json()["api_key"]["key"])
    dump = subprocess.run(
        ["pg_dump", "--data-only", db_url(TEST_DB)], capture_output=True, text=True, check=True
    ).stdout
    assert "api_keys" in dump
    for key in keys:
        assert key not in dump
        assert key[11:] not in dump  # not even the secret part


def test_key_pagination_walks_every_key_once(client, world):
    t = world.tenant("acme")
    admin_key = world.key(t)
    for i in range(11):
        world.key(t, name=f"k{i}")
    seen, cursor = [], None
    while True:
        params = {"limit": 4, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/keys", headers=auth(admin_key), params=params).json()
        seen += [k["id"] for k in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == 12 and len(set(seen)) == 12
    bad = client.get("/v1/keys", headers=auth(admin_key), params={"cursor": "garbage"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_cursor"
    big = client.get("/v1/keys", headers=auth(admin_key), params={"limit": 10_000})
    assert big.status_code == 422 and big.json()["errors"][0]["field"] == "query.limit"
