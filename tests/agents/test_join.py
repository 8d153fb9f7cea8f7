"""A node agent joins with an operator's single-use token and then speaks only for its node."""

from __future__ import annotations

import subprocess
import sys

from sqlalchemy import select, text, update

from tests.fixtures.world import SMALL_FLEET, auth


def _node_id(client, op: str, name: str) -> str:
    nodes = client.get("/v1/admin/nodes", params={"limit": 500}, headers=auth(op)).json()["items"]
    return next(n["id"] for n in nodes if n["name"] == name)


def test_an_agent_joins_once_speaks_for_its_node_and_can_be_cut_off(client, world, session):
    from app.models.agents import NodeCredential, NodeJoinToken

    world.fleet(SMALL_FLEET)
    op = world.key()
    tenant_key = world.key(world.tenant("acme"))
    node = _node_id(client, op, "h100-1")

    # Only an operator makes a join token, for a node that exists.
    url = f"/v1/admin/nodes/{node}/join-tokens"
    assert client.post(url, headers=auth(tenant_key)).status_code == 403
    missing = client.post(
        "/v1/admin/nodes/00000000-0000-0000-0000-000000000000/join-tokens", headers=auth(op)
    )
    assert missing.status_code == 404
    made = client.post(url, headers=auth(op))
    assert made.status_code == 201, made.text
    token = made.json()["token"]
    assert token.startswith("rpj_") and made.json()["node_name"] == "h100-1"

    # Traded once for the node's credential; a second use, or a made-up token, is refused.
    joined = client.post("/v1/agent/join", json={"token": token})
    assert joined.status_code == 201, joined.text
    cred = joined.json()["credential"]
    assert cred.startswith("rpn_") and joined.json()["node_name"] == "h100-1"
    again = client.post("/v1/agent/join", json={"token": token})
    assert again.status_code == 401 and again.json()["code"] == "invalid_join_token"
    forged = client.post("/v1/agent/join", json={"token": "rpj_" + "A" * 40})
    assert forged.status_code == 401 and forged.json()["code"] == "invalid_join_token"

    # Only hashes are stored.
    session.expire_all()
    stored = session.execute(text("SELECT * FROM node_credentials")).all()
    stored += session.execute(text("SELECT * FROM node_join_tokens")).all()
    assert stored and not any(
        cred in str(v) or token in str(v) or cred[4:] in str(v) for row in stored for v in row
    )

    # The credential speaks for its node; API keys are not node credentials.
    me = client.get("/v1/agent/node", headers=auth(cred))
    assert me.status_code == 200, me.text
    assert (me.json()["node_name"], me.json()["rack"], me.json()["gpus"]) == ("h100-1", "hgx-1", 8)
    for key in (tenant_key, op, None):
        r = client.get("/v1/agent/node", headers=auth(key) if key else {})
        assert r.status_code == 401 and r.json()["code"] == "invalid_node_credential"

    # An expired token is refused like a used one.
    late = client.post(url, json={"ttl_s": 60}, headers=auth(op)).json()["token"]
    session.execute(update(NodeJoinToken).values(expires_at=text("now() - interval '1 second'")))
    session.commit()
    r = client.post("/v1/agent/join", json={"token": late})
    assert r.status_code == 401 and r.json()["code"] == "invalid_join_token"

    # Rotation: the new credential works, the one presented stops.
    rotated = client.post("/v1/agent/credentials:rotate", headers=auth(cred))
    assert rotated.status_code == 201, rotated.text
    fresh = rotated.json()["credential"]
    assert client.get("/v1/agent/node", headers=auth(cred)).status_code == 401
    assert client.get("/v1/agent/node", headers=auth(fresh)).status_code == 200

    # An operator cuts the node's agent off: 401 from its next request.
    revoked = client.post(f"/v1/admin/nodes/{node}/credentials:revoke", headers=auth(op))
    assert revoked.status_code == 200 and revoked.json()["revoked"] == 1
    assert client.get("/v1/agent/node", headers=auth(fresh)).status_code == 401
    session.expire_all()
    live = session.scalars(select(NodeCredential).where(NodeCredential.revoked_at.is_(None)))
    assert list(live) == []


def test_two_agents_racing_with_one_token_get_one_credential(world, session):
    from concurrent.futures import ThreadPoolExecutor

    from app.agents import service
    from app.core.db import session_scope
    from app.core.errors import AppError

    world.fleet(SMALL_FLEET)
    with session_scope() as s:
        token = service.create_join_token(s, service.node_named(s, "h100-2")).token

    def attempt(_: int) -> str:
        try:
            with session_scope() as s:
                return service.join(s, token).credential
        except AppError as e:
            return e.code

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(attempt, range(4)))
    assert sorted(r.startswith("rpn_") for r in results) == [False, False, False, True]
    assert results.count("invalid_join_token") == 3


def test_the_cli_makes_a_join_token(world, client):
    world.fleet(SMALL_FLEET)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "fleet",
            "join-token",
            "h100-1",
            "--ttl",
            "120",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    token = __import__("json").loads(out.stdout)["token"]
    assert client.post("/v1/agent/join", json={"token": token}).status_code == 201
    missing = subprocess.run(
        [sys.executable, "-m", "app.cli", "fleet", "join-token", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no node named nope" in missing.stderr


def test_a_replayed_join_never_carries_the_credential(client, world):
    """An anonymous request's replay goes to whoever sends the same key and body: a join's
    answer is the node's credential, so the replay names the node and withholds it."""
    world.fleet(SMALL_FLEET)
    op = world.key()
    node = _node_id(client, op, "h100-1")
    token = client.post(f"/v1/admin/nodes/{node}/join-tokens", headers=auth(op)).json()["token"]
    headers = {"Idempotency-Key": "join-once"}
    first = client.post("/v1/agent/join", json={"token": token}, headers=headers)
    assert first.status_code == 201 and first.json()["credential"].startswith("rpn_")
    replay = client.post("/v1/agent/join", json={"token": token}, headers=headers)
    assert replay.status_code == 201, replay.text
    assert replay.json()["node_name"] == "h100-1" and replay.json()["credential"] is None
