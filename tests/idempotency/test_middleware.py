"""`Idempotency-Key` as a hostile caller sees it (real PostgreSQL): a stored response is served
only to a caller who authenticates as its account and may use the route; records are per
account; bodies compare canonically; nothing secret is stored readable; DELETE repeats."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from app.core.db import session_scope
from app.models.tenants import Tenant
from tests.fixtures.harness import ROOT, TEST_DB, db_url
from tests.fixtures.world import CORDONED_H100, auth

FLEET = CORDONED_H100
POLICY = ["shared-fractional", "shared-mig", "dedicated-gpu", "vm"]


def _h(key: str, idem: str, **extra: str) -> dict[str, str]:
    return {**auth(key), "Idempotency-Key": idem, **extra}


def _forged(key: str) -> str:
    """A well-formed key with the same public prefix and another secret."""
    return key[:11] + ("A" if key[11] != "A" else "B") + key[12:]


def test_a_stranger_with_the_prefix_cannot_replay_a_new_key(client, world):
    t = world.tenant("acme")
    admin = world.key(t)
    body = {"name": "ci", "scopes": ["read"]}
    first = client.post("/v1/keys", json=body, headers=_h(admin, "k-1"))
    assert first.status_code == 201, first.text
    secret = first.json()["key"]
    forged = client.post("/v1/keys", json=body, headers=_h(_forged(admin), "k-1"))
    assert forged.status_code == 401 and secret not in forged.text
    # The owner's retry is a replay of the same key.
    again = client.post("/v1/keys", json=body, headers=_h(admin, "k-1"))
    assert again.status_code == 201 and again.json()["key"] == secret
    assert again.headers["idempotent-replayed"] == "true"


def test_a_revoked_key_cannot_replay(client, world):
    t = world.tenant("acme")
    admin = world.key(t)
    body = {"name": "ci", "scopes": ["read"]}
    assert client.post("/v1/keys", json=body, headers=_h(admin, "k-2")).status_code == 201
    me = client.get("/v1/keys", headers=auth(admin)).json()["items"]
    mine = next(k for k in me if k["prefix"] == admin[3:11])
    other_admin = world.key(t, name="second admin")
    assert client.delete(f"/v1/keys/{mine['id']}", headers=auth(other_admin)).status_code == 200
    replay = client.post("/v1/keys", json=body, headers=_h(admin, "k-2"))
    assert replay.status_code == 401 and replay.json()["code"] == "revoked_api_key"


def test_a_replay_goes_only_to_the_key_that_sent_it(client, world):
    """Another key of the same tenant sending an admin key's request with its Idempotency-Key
    never gets the stored answer (it carries the new admin secret): its request is its own,
    judged by its own scopes, on REST and GraphQL alike (issue 45 item 17: records are the
    key's, not the account's)."""
    t = world.tenant("acme")
    admin, reader = world.key(t), world.key(t, scopes=("read",), name="reader")
    second_admin = world.key(t, name="second admin")
    body = {"name": "ci", "scopes": ["read", "write", "admin"]}
    first = client.post("/v1/keys", json=body, headers=_h(admin, "k-3"))
    assert first.status_code == 201
    secret = first.json()["key"]
    denied = client.post("/v1/keys", json=body, headers=_h(reader, "k-3"))
    assert denied.status_code == 403 and secret not in denied.text
    own = client.post("/v1/keys", json=body, headers=_h(second_admin, "k-3"))
    assert own.status_code == 201 and own.json()["key"] != secret
    assert "idempotent-replayed" not in own.headers
    q = (
        'mutation { createApiKey(input: {name: "ci", scopes: ["admin"]}) '
        "{ ... on NewApiKey { key } } }"
    )
    made = client.post("/graphql", json={"query": q}, headers=_h(admin, "g-1"))
    assert made.status_code == 200, made.text
    new_secret = made.json()["data"]["createApiKey"]["key"]
    assert new_secret.startswith("rp_")
    stolen = client.post("/graphql", json={"query": q}, headers=_h(reader, "g-1"))
    assert new_secret not in stolen.text and "rp_" not in stolen.text, stolen.text
    # The owner's retry is still the first answer, and only one key was made.
    again = client.post("/graphql", json={"query": q}, headers=_h(admin, "g-1"))
    assert again.json() == made.json() and again.headers["idempotent-replayed"] == "true"
    names = [k["name"] for k in client.get("/v1/keys", headers=auth(admin)).json()["items"]]
    assert names.count("ci") == 3  # two by REST (each admin key its own), one by GraphQL
    assert client.get("/v1/keys", headers=auth(new_secret)).status_code == 200


def test_a_replay_needs_the_standing_the_first_request_had(client, world):
    """Suspended since: the same key's replay is refused, as the request itself would be."""
    t = world.tenant("acme")
    admin = world.key(t)
    body = {"name": "ci", "scopes": ["read"]}
    q = 'mutation { createApiKey(input: {name: "ci", scopes: ["read"]}) { __typename } }'
    assert client.post("/graphql", json={"query": q}, headers=_h(admin, "g-2")).status_code == 200
    assert client.post("/v1/keys", json=body, headers=_h(admin, "k-4")).status_code == 201
    with session_scope() as s:
        s.get(Tenant, t.id).status = "suspended"
    refused = client.post("/v1/keys", json=body, headers=_h(admin, "k-4"))
    assert refused.status_code == 409 and "rp_" not in refused.text
    replay = client.post("/graphql", json={"query": q}, headers=_h(admin, "g-2"))
    assert replay.status_code == 409 and "rp_" not in replay.text


def test_records_are_the_keys_so_a_read_key_blocks_no_one(client, world):
    """Issue 45 item 17: scoped per account, a read key's request (refused, 403) claimed a
    predictable Idempotency-Key for the account's other keys for 24 h."""
    world.fleet(FLEET)
    t = world.tenant("acme", policy=POLICY)
    a, b = world.key(t, name="a"), world.key(t, name="b")
    reader = world.key(t, scopes=("read",), name="reader")
    body = {"kind": "instance", "gpus": 1}
    squat = client.post("/v1/workloads", json=body, headers=_h(reader, "submit-1"))
    assert squat.status_code == 403
    one = client.post("/v1/workloads", json=body, headers=_h(a, "submit-1"))
    two = client.post("/v1/workloads", json=body, headers=_h(b, "submit-1"))
    assert one.status_code == two.status_code == 201, (one.text, two.text)
    assert one.json()["id"] != two.json()["id"]
    again = client.post("/v1/workloads", json=body, headers=_h(a, "submit-1"))
    assert again.json()["id"] == one.json()["id"] and again.headers["idempotent-replayed"]
    assert len(client.get("/v1/workloads", headers=auth(a)).json()["items"]) == 2
    # Another tenant's identical request is its own.
    other = world.tenant("other", policy=POLICY)
    mine = client.post("/v1/workloads", json=body, headers=_h(world.key(other), "submit-1"))
    assert mine.status_code == 201 and mine.json()["id"] != one.json()["id"]
    assert "idempotent-replayed" not in mine.headers


def test_each_operator_key_has_its_own_namespace(client, world):
    op1, op2 = world.key(None, name="op1"), world.key(None, name="op2")
    body = {"name": "Acme", "slug": "acme", "contact_email": "ops@acme.io"}
    a = client.post("/v1/admin/tenants", json=body, headers=_h(op1, "t-1"))
    b = client.post("/v1/admin/tenants", json=body, headers=_h(op2, "t-1"))
    # op2's request is its own: the slug is taken, not the Idempotency-Key.
    assert a.status_code == 201 and b.status_code == 409, b.text
    assert b.json()["code"] != "idempotency_key_reused"
    again = client.post("/v1/admin/tenants", json=body, headers=_h(op1, "t-1"))
    assert again.status_code == 201 and again.json()["id"] == a.json()["id"]


def test_bodies_compare_canonically(client, world):
    world.fleet(FLEET)
    t = world.tenant("acme", policy=POLICY)
    key = world.key(t)
    first = client.post(
        "/v1/workloads",
        content=b'{"kind": "instance", "gpus": 1}',
        headers=_h(key, "c-1", **{"Content-Type": "application/json"}),
    )
    same = client.post(
        "/v1/workloads",
        content=b'{\n  "gpus":1,"kind":"instance"\n}',
        headers=_h(key, "c-1", **{"Content-Type": "application/json; charset=utf-8"}),
    )
    assert first.status_code == same.status_code == 201, same.text
    assert same.json()["id"] == first.json()["id"]
    other = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 2}, headers=_h(key, "c-1")
    )
    assert other.status_code == 409
    problem = other.json()
    assert problem["code"] == "idempotency_key_reused"
    assert problem["instance"] == "/v1/workloads"


def test_a_signup_replay_never_repeats_the_secret(client):
    body = {"name": "S", "slug": "signup-co", "contact_email": "s@s.io"}
    first = client.post("/v1/signup", json=body, headers={"Idempotency-Key": "s-1"})
    assert first.status_code == 201
    assert first.json()["api_key"]["key"].startswith("rp_")
    replay = client.post("/v1/signup", json=body, headers={"Idempotency-Key": "s-1"})
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    out = replay.json()
    assert out["tenant"]["id"] == first.json()["tenant"]["id"]
    assert out["api_key"]["key"] is None
    assert out["api_key"]["prefix"] == first.json()["api_key"]["prefix"]


def test_delete_repeats_as_the_first(client, world):
    world.fleet(FLEET)
    t = world.tenant("acme", policy=POLICY)
    key = world.key(t)
    wid = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
    wid = wid.json()["id"]
    first = client.delete(f"/v1/workloads/{wid}", headers=auth(key))
    again = client.delete(f"/v1/workloads/{wid}", headers=auth(key))
    assert first.status_code == again.status_code == 200
    assert again.json()["state"] == "terminated"
    assert again.json()["finished_at"] == first.json()["finished_at"]
    with_key = client.delete(f"/v1/workloads/{wid}", headers=_h(key, "d-1"))
    replay = client.delete(f"/v1/workloads/{wid}", headers=_h(key, "d-1"))
    assert with_key.status_code == replay.status_code == 200
    assert replay.headers["idempotent-replayed"] == "true"


@pytest.mark.skipif(shutil.which("pg_dump") is None, reason="pg_dump not installed")
def test_a_dump_holds_no_key_created_with_or_without_idempotency(client, world, session):
    from sqlalchemy import text

    t = world.tenant("acme")
    admin, op = world.key(t), world.key(None)
    made = [admin, op]
    for i, h in enumerate([auth(admin), _h(admin, "dump-1")]):
        made.append(client.post("/v1/keys", json={"name": f"k{i}"}, headers=h).json()["key"])
    made.append(
        client.post(
            f"/v1/admin/tenants/{t.id}/keys", json={"name": "x"}, headers=_h(op, "dump-2")
        ).json()["key"]
    )
    made.append(
        client.post(
            "/v1/signup",
            json={"name": "S", "slug": "signup-co", "contact_email": "s@s.io"},
            headers={"Idempotency-Key": "dump-3"},
        ).json()["api_key"]["key"]
    )
    stored = session.execute(text("SELECT response_body FROM idempotency_records")).all()
    assert len(stored) == 3
    dump = subprocess.run(
        ["pg_dump", "--data-only", db_url(TEST_DB)], capture_output=True, text=True, check=True
    ).stdout
    for key in made:
        secret = key[11:]
        assert secret not in dump and secret.encode().hex() not in dump
        for (body,) in stored:
            assert secret.encode() not in bytes(body)


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_server_secrets_are_generated_on_sqlite_and_required_on_postgres(tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in ("RACKPLANE_KEY_PEPPER",)}
    embedded = {**base, "RACKPLANE_DATA_DIR": str(tmp_path)}
    embedded.pop("DATABASE_URL", None)
    code = "from app.core.secrets import server_secret; print(server_secret('key_pepper').decode())"
    one, two = _run(code, embedded), _run(code, embedded)
    assert one.returncode == 0, one.stderr
    assert one.stdout == two.stdout and len(one.stdout.strip()) >= 32
    path = tmp_path / "secrets" / "key_pepper"
    assert path.read_text().strip() == one.stdout.strip()
    assert path.stat().st_mode & 0o077 == 0
    refused = subprocess.run(
        [sys.executable, "-m", "app.cli", "up", "--no-worker"],
        cwd=ROOT,
        env={**base, "RACKPLANE_DATA_DIR": str(tmp_path / "pg")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "RACKPLANE_KEY_PEPPER is not set" in refused.stderr
