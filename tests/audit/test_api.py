"""The audit log on real PostgreSQL: one entry per mutating request, in the transaction of its
change (or on its own when the request was refused), naming the key by id and prefix and
never holding a secret or a body; tenants read their own, operators everyone's; the database
refuses to update or delete an entry."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from tests.fixtures.world import CORDONED_H100, auth

FLEET = CORDONED_H100
POLICY = ["shared-fractional", "shared-mig", "dedicated-gpu", "vm"]


@pytest.fixture
def acme(world):
    world.fleet(FLEET)
    t = world.tenant("acme", policy=POLICY)
    return t, world.key(t)


def _entries(session, **where) -> list[dict]:
    session.rollback()
    cond = " AND ".join(f"{k} = :{k}" for k in where) or "true"
    rows = session.execute(
        text(f"SELECT * FROM audit_log WHERE {cond} ORDER BY created_at, id"), where
    ).mappings()
    return [dict(r) for r in rows]


def test_a_change_and_its_entry_commit_together(client, session, acme):
    t, key = acme
    r = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 1},
        headers={**auth(key), "X-Request-ID": "req-audit-1"},
    )
    assert r.status_code == 201
    wid = r.json()["id"]
    [entry] = _entries(session, request_id="req-audit-1")
    assert entry["principal"] == "tenant" and entry["key_prefix"] == key[3:11]
    assert entry["tenant_id"] == t.id and entry["status"] == 201
    assert entry["action"] == "POST /v1/workloads"
    assert (entry["target_type"], entry["target_id"]) == ("workload", wid)
    # The same transaction wrote both rows.
    xids = session.execute(
        text(
            "SELECT (SELECT xmin::text FROM workloads WHERE id = :w), "
            "(SELECT xmin::text FROM audit_log WHERE request_id = 'req-audit-1')"
        ),
        {"w": wid},
    ).one()
    assert xids[0] == xids[1]
    d = client.delete(f"/v1/workloads/{wid}", headers={**auth(key), "X-Request-ID": "req-2"})
    assert d.status_code == 200
    [gone] = _entries(session, request_id="req-2")
    assert gone["action"] == "DELETE /v1/workloads/{workload_id}"
    assert (gone["target_type"], gone["target_id"], gone["status"]) == ("workload", wid, 200)


@pytest.mark.parametrize(
    "method, path, body, headers, status",
    [
        ("POST", "/v1/workloads", {"kind": "instance"}, "tenant", 422),
        ("POST", "/v1/admin/tenants", {"name": "x"}, "tenant", 403),
        ("POST", "/v1/workloads", {"kind": "instance", "gpus": 1}, "forged", 401),
        ("DELETE", "/v1/workloads/00000000-0000-4000-8000-000000000000", None, "tenant", 404),
    ],
)
def test_refused_requests_are_recorded_on_their_own(
    client, session, acme, method, path, body, headers, status
):
    t, key = acme
    h = auth(key) if headers == "tenant" else auth(key[:11] + "x" * 40)
    r = client.request(method, path, json=body, headers={**h, "X-Request-ID": "req-refused"})
    assert r.status_code == status
    [entry] = _entries(session, request_id="req-refused")
    assert entry["status"] == status and entry["action"].startswith(method)
    if headers == "forged":  # not authenticated: the claimed public prefix, no tenant, no key id
        assert entry["principal"] == "anonymous" and entry["key_id"] is None
        assert entry["key_prefix"] == key[3:11] and entry["tenant_id"] is None
    else:
        assert entry["principal"] == "tenant" and entry["tenant_id"] == t.id


def test_entries_hold_no_secret_and_no_body(client, session, acme):
    _, key = acme
    made = client.post(
        "/v1/keys", json={"name": "ci robot"}, headers={**auth(key), "X-Request-ID": "k"}
    )
    secret = made.json()["key"]
    signup = client.post(
        "/v1/signup",
        json={"name": "Signup Co", "slug": "signup-co", "contact_email": "s@s.io"},
        headers={"X-Request-ID": "s"},
    )
    rows = json.dumps(_entries(session), default=str)
    assert secret[11:] not in rows and signup.json()["api_key"]["key"][11:] not in rows
    assert "ci robot" not in rows and "Signup Co" not in rows
    [new] = _entries(session, request_id="s")
    assert new["principal"] == "anonymous"
    assert str(new["tenant_id"]) == signup.json()["tenant"]["id"]  # the new tenant sees it


def test_tenants_read_their_own_and_operators_read_everyone(client, world, session, acme):
    t, key = acme
    other = world.tenant("other", policy=POLICY)
    okey, op = world.key(other), world.key(None)
    ids = []
    for _ in range(3):
        r = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
        ids.append(r.json()["id"])
    client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(okey))
    r = client.put(
        f"/v1/admin/tenants/{t.id}/quotas",
        json={"quotas": [{"gpu_model": "H100-80GB", "guaranteed_milli": 1000}]},
        headers=auth(op),
    )
    assert r.status_code == 200
    seen, cursor = [], None
    while True:
        page = client.get(
            "/v1/audit",
            params={"limit": 2, **({"cursor": cursor} if cursor else {})},
            headers=auth(key),
        ).json()
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [e["target_id"] for e in seen if e["action"] == "POST /v1/workloads"] == ids
    assert all(e["tenant_id"] == str(t.id) for e in seen)
    quota = [e for e in seen if e["action"].startswith("PUT /v1/admin/tenants")]
    # The operator's change to the tenant is shown, without the operator's key.
    assert quota and quota[0]["principal"] == "operator" and quota[0]["key_id"] is None
    only = client.get(
        "/v1/audit", params={"target_type": "workload", "target_id": ids[1]}, headers=auth(key)
    ).json()["items"]
    assert [e["target_id"] for e in only] == [ids[1]]
    assert client.get("/v1/admin/audit", headers=auth(key)).status_code == 403
    everyone = client.get("/v1/admin/audit", params={"limit": 500}, headers=auth(op)).json()
    tenants = {e["tenant_id"] for e in everyone["items"]}
    assert {str(t.id), str(other.id)} <= tenants
    assert any(e["key_prefix"] == op[3:11] for e in everyone["items"])
    mine = client.get(
        "/v1/admin/audit", params={"tenant_id": str(other.id)}, headers=auth(op)
    ).json()["items"]
    assert mine and all(e["tenant_id"] == str(other.id) for e in mine)


def test_the_database_refuses_to_rewrite_history(client, session, acme):
    _, key = acme
    client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
    assert _entries(session)
    for statement in ("UPDATE audit_log SET status = 200", "DELETE FROM audit_log"):
        with pytest.raises(DBAPIError, match="append-only"):
            session.execute(text(statement))
        session.rollback()
    assert len(_entries(session)) == 1
