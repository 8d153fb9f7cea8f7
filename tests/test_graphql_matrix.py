"""GraphQL's access matrix, as tests/test_security_matrix.py is REST's: every root field has a
row saying who may use it, and a new field without one fails. Each row is checked for every
kind of caller: no key, a tenant key (read-only and read-write), another tenant's key, an
operator key. Nested fields are reachable only through their root, whose check covers them
(and whose loaders read through the tenant scope)."""

from __future__ import annotations

import pytest

from app.graphql.schema import schema
from tests.conftest import auth
from tests.test_placement_worker import ALL, fleet

MISSING = "00000000-0000-4000-8000-000000000000"

# Root field -> (who: tenant-read | tenant-write | platform, a query using it; {id} is filled
# with a workload of the tenant that owns the row's object).
MATRIX = {
    "viewer": ("tenant-read", "{ viewer { slug } }"),
    "workloads": ("tenant-read", "{ workloads { edges { node { id events { seq } } } } }"),
    "workload": ("tenant-read", 'query { workload(id: "{id}") { id placement { node } } }'),
    "nodes": ("platform", "{ nodes { edges { node { name gpus { holders { tenantId } } } } } }"),
    "submitWorkload": (
        "tenant-write",
        'mutation { submitWorkload(input: {kind: "instance", gpus: 1}) '
        "{ __typename ... on Problem { code } } }",
    ),
    "terminateWorkload": (
        "tenant-write",
        'mutation { terminateWorkload(id: "{id}") { __typename ... on Problem { code } } }',
    ),
}


def root_fields() -> set[str]:
    gs = schema._schema
    out = set(gs.query_type.fields)
    if gs.mutation_type is not None:
        out |= set(gs.mutation_type.fields)
    if gs.subscription_type is not None:
        out |= set(gs.subscription_type.fields)
    return out


def test_every_root_field_has_a_row():
    assert root_fields() == set(MATRIX), "add the new field to MATRIX (and its check)"


@pytest.fixture
def callers(client, world):
    world.fleet(fleet(1))
    acme = world.tenant("acme", policy=ALL)
    keys = {
        "acme": world.key(acme),
        "acme-read": world.key(acme, scopes=("read",)),
        "globex": world.key(world.tenant("globex", policy=ALL)),
        "operator": world.key(None),
    }
    wid = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(keys["acme"])
    ).json()["id"]
    return keys, wid


def run(client, key, query):
    r = client.post("/graphql", json={"query": query}, headers=auth(key) if key else {})
    assert r.status_code == 200, r.text
    return r.json()


def refusal(body) -> str | None:
    """The code a caller was refused with: a GraphQL error's, or a typed problem's."""
    if body.get("errors"):
        return body["errors"][0]["extensions"]["code"]
    value = next(iter((body.get("data") or {}).values()))
    if isinstance(value, dict) and value.get("__typename", "").endswith("Problem"):
        return value["code"]
    return None


@pytest.mark.parametrize("field", sorted(MATRIX))
def test_who_may_use_each_field(client, callers, field):
    keys, wid = callers
    who, query = MATRIX[field]
    q = query.replace("{id}", wid)
    assert refusal(run(client, None, q)) == "missing_api_key"
    if who == "platform":
        assert refusal(run(client, keys["acme"], q)) == "platform_scope_required"
        assert refusal(run(client, keys["operator"], q)) is None
        return
    assert refusal(run(client, keys["operator"], q)) == "tenant_key_required"
    if who == "tenant-write":
        assert refusal(run(client, keys["acme-read"], q)) == "insufficient_scope"
    # The owner may; another tenant gets nothing of the owner's.
    if "{id}" in query:
        assert refusal(run(client, keys["globex"], q)) == "workload_not_found"
        missing = query.replace("{id}", MISSING)
        assert refusal(run(client, keys["acme"], missing)) == "workload_not_found"
    else:
        body = run(client, keys["globex"], q)
        assert wid not in str(body)
    assert refusal(run(client, keys["acme"], q)) is None
