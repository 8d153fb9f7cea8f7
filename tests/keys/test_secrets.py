"""Tenant secrets (issue 45 item 13): a value goes in (`PUT /v1/secrets/{name}`), is stored
sealed, and comes out only as the environment of a run its workload starts, through the node
that starts it; no read of the secret, the workload, its events or the audit log shows it."""

from __future__ import annotations

from sqlalchemy import select, text

from tests.fixtures.agent_api import AGENT_FLEET, bring_up, fake_inventory, join_node
from tests.fixtures.world import auth, wait_until

VALUE = "hf_" + "s3cr3t" * 6


def test_a_secret_reaches_only_the_run_that_names_it(client, world, session, celery_worker_process):
    from app.models.keys import TenantSecret

    world.fleet(AGENT_FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    other = world.key(world.tenant("beta"))

    made = client.put("/v1/secrets/hf-token", json={"value": VALUE}, headers=auth(key))
    assert made.status_code == 201, made.text
    assert made.json()["size"] == len(VALUE) and made.json()["version"] == 1
    assert VALUE not in made.text
    again = client.put("/v1/secrets/hf-token", json={"value": VALUE + "2"}, headers=auth(key))
    assert again.status_code == 200 and again.json()["version"] == 2
    listed = client.get("/v1/secrets", headers=auth(key))
    assert [s["name"] for s in listed.json()["items"]] == ["hf-token"] and VALUE not in listed.text
    # Another tenant's, or an operator: not theirs to see.
    assert client.get("/v1/secrets/hf-token", headers=auth(other)).status_code == 404
    assert client.get("/v1/secrets", headers=auth(other)).json()["items"] == []
    assert client.get("/v1/secrets", headers=auth(op)).status_code == 403
    # Bad input: a clear error, nothing written.
    bad = client.put("/v1/secrets/no spaces", json={"value": "x"}, headers=auth(key))
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
    assert client.put("/v1/secrets/x", json={"value": ""}, headers=auth(key)).status_code == 422
    # Sealed at rest: the row holds no plaintext.
    session.expire_all()
    raw = session.execute(text("SELECT sealed FROM tenant_secrets")).scalar_one()
    assert VALUE.encode() not in bytes(raw)

    # A workload names it; one naming a secret the tenant does not have is refused.
    job = {"kind": "job", "gpus": 4, "region": "r1", "command": ["sleep", "60"]}
    unknown = client.post(
        "/v1/workloads", json={**job, "secret_env": {"HF_TOKEN": "nope"}}, headers=auth(key)
    )
    assert unknown.status_code == 422 and unknown.json()["code"] == "unknown_secret"
    theirs = client.post(
        "/v1/workloads", json={**job, "secret_env": {"HF_TOKEN": "hf-token"}}, headers=auth(other)
    )
    assert theirs.status_code == 422 and theirs.json()["code"] == "unknown_secret"
    clash = {**job, "env": {"HF_TOKEN": "x"}, "secret_env": {"HF_TOKEN": "hf-token"}}
    assert client.post("/v1/workloads", json=clash, headers=auth(key)).status_code == 422
    reserved = {**job, "secret_env": {"RACKPLANE_TOKEN": "hf-token"}}
    assert client.post("/v1/workloads", json=reserved, headers=auth(key)).status_code == 422
    creds = {n: join_node(client, op, n) for n in ("a-1", "a-2")}
    for n in creds:
        bring_up(client, creds[n], fake_inventory(n))
    submitted = client.post(
        "/v1/workloads",
        json={**job, "secret_env": {"HF_TOKEN": "hf-token"}, "workdir": "src/app"},
        headers=auth(key),
    )
    assert submitted.status_code == 201, submitted.text
    wid = submitted.json()["id"]
    assert submitted.json()["secret_env"] == {"HF_TOKEN": "hf-token"}
    assert submitted.json()["workdir"] == "src/app"
    wait_until(
        lambda: (
            client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "provisioning"
        ),
        timeout=30,
    )

    # The node that holds its run gets the value (the current version) as the run starts; the
    # node's desired state never carries it.
    held = None
    for node, cred in creds.items():
        desired = client.get("/v1/agent/assignments", headers=auth(cred))
        assert VALUE not in desired.text
        for a in desired.json()["assignments"]:
            if a["workload_id"] == wid:
                held = (node, a["attempt"])
                assert a["workdir"] == "src/app"  # where its node starts it
    assert held is not None
    node, attempt = held
    env = client.get(f"/v1/agent/runs/{wid}/{attempt}/0/env", headers=auth(creds[node]))
    assert env.status_code == 200 and env.json()["env"]["HF_TOKEN"] == VALUE + "2", env.text
    elsewhere = "a-2" if node == "a-1" else "a-1"
    refused = client.get(f"/v1/agent/runs/{wid}/{attempt}/0/env", headers=auth(creds[elsewhere]))
    assert refused.status_code == 409

    # In use: not deleted. Gone anyway (its row removed behind the API's back): the run is
    # refused, as the workload's own failure to start, naming the secret, not its value.
    busy = client.delete("/v1/secrets/hf-token", headers=auth(key))
    assert busy.status_code == 409 and busy.json()["code"] == "secret_in_use"
    assert wid in busy.json()["workloads"]
    session.execute(TenantSecret.__table__.delete())
    session.commit()
    gone = client.get(f"/v1/agent/runs/{wid}/{attempt}/0/env", headers=auth(creds[node]))
    assert gone.status_code == 409 and gone.json()["code"] == "run_refused", gone.text
    assert "secret 'hf-token' (for HF_TOKEN) is gone" in gone.json()["detail"]

    # Nothing the tenant or an operator reads shows the value.
    for path, who in (
        (f"/v1/workloads/{wid}/events", key),
        ("/v1/audit", key),
        ("/v1/admin/audit", op),
        (f"/v1/workloads/{wid}", key),
    ):
        got = client.get(path, headers=auth(who))
        assert got.status_code in (200, 404) and VALUE not in got.text, path
    client.delete(f"/v1/workloads/{wid}", headers=auth(key))
    client.put("/v1/secrets/hf-token", json={"value": VALUE}, headers=auth(key))
    assert client.delete("/v1/secrets/hf-token", headers=auth(key)).status_code == 204
    session.expire_all()
    assert session.scalar(select(TenantSecret.id).where(TenantSecret.name == "hf-token")) is None


def test_graphql_sets_lists_and_deletes_secrets_with_rest_codes(client, world):
    from tests.fixtures.graphql import gql

    key = world.key(world.tenant("acme"))
    put = """mutation($n: String!, $v: String!) { putSecret(input: {name: $n, value: $v}) {
        __typename ... on Secret { name size version } ... on Problem { code } } }"""
    got = gql(client, key, put, n="db-pass", v=VALUE)["data"]["putSecret"]
    assert got == {"__typename": "Secret", "name": "db-pass", "size": len(VALUE), "version": 1}
    got = gql(client, key, put, n="db-pass", v="other")["data"]["putSecret"]
    assert got["version"] == 2 and got["size"] == 5
    bad = gql(client, key, put, n="no spaces", v="x")["data"]["putSecret"]
    assert bad["code"] == "validation_error", bad
    listed = gql(client, key, "{ secrets { edges { node { name size } } } }")
    assert listed["data"]["secrets"]["edges"] == [{"node": {"name": "db-pass", "size": 5}}]
    assert VALUE not in str(listed)
    delete = """mutation($n: String!) { deleteSecret(name: $n) {
        __typename ... on Secret { name } ... on Problem { code } } }"""
    assert gql(client, key, delete, n="db-pass")["data"]["deleteSecret"]["name"] == "db-pass"
    assert gql(client, key, delete, n="db-pass")["data"]["deleteSecret"]["code"] == (
        "secret_not_found"
    )
    # REST and GraphQL are one implementation: what one set, the other reads.
    assert client.get("/v1/secrets", headers=auth(key)).json()["items"] == []


def test_a_value_that_does_not_coerce_is_not_repeated_back(client, world):
    """graphql-core repeats a variable's value when it does not coerce: a secret sent with its
    name missing must not come back in the error."""
    from tests.fixtures.graphql import codes, gql

    key = world.key(world.tenant("acme"))
    put = "mutation($i: SecretInput!) { putSecret(input: $i) { __typename } }"
    body = gql(client, key, put, i={"value": VALUE})
    assert codes(body) == ["invalid_variables"] and VALUE not in str(body), body
    assert "'name'" in body["errors"][0]["message"], body
    extra = gql(client, key, put, i={"name": "x", "value": VALUE, "other": 1})
    assert codes(extra) == ["invalid_variables"] and VALUE not in str(extra), extra
    # A name that could never be one is simply not there (no internal error).
    gone = gql(
        client,
        key,
        'mutation { deleteSecret(name: "a\\u0000b") { __typename ... on Problem { code } } }',
    )
    assert gone["data"]["deleteSecret"]["code"] == "secret_not_found", gone
