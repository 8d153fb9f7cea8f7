"""The portal's GraphQL API (`/graphql`): the same keys, services and tenancy scoping as REST,
REST's error codes, limits checked before execution, no N+1, and an SDL that matches the code."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from app.core.db import get_engine
from app.graphql.schema import schema
from tests.conftest import ROOT, auth
from tests.test_placement_worker import ALL, fleet

PAGE = """
query Page($first: Int!, $after: String, $state: String) {
  viewer { slug status isolationPolicy }
  workloads(first: $first, after: $after, state: $state) {
    edges { cursor node { id state kind gpuMilli placement { node gpuIndices }
            events { seq toState reason } } }
    pageInfo { hasNextPage endCursor }
  }
}
"""


def gql(client, key, query, **variables):
    headers = auth(key) if key else {}
    r = client.post("/graphql", json={"query": query, "variables": variables}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def codes(body):
    return [e["extensions"]["code"] for e in body.get("errors") or []]


def submit(client, key, n):
    return [
        client.post(
            "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)
        ).json()["id"]
        for _ in range(n)
    ]


def test_the_sdl_in_the_repository_is_the_schema():
    committed = (ROOT / "sdl" / "schema.graphql").read_text()
    assert committed == schema.as_str() + "\n", "sdl/schema.graphql is stale: `make openapi`"


def test_a_tenant_reads_its_workloads_a_page_at_a_time(client, world):
    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    ids = submit(client, key, 3)
    body = gql(client, key, PAGE, first=2)
    assert "errors" not in body, body
    data = body["data"]
    assert data["viewer"]["slug"] == "acme" and data["viewer"]["status"] == "active"
    edges = data["workloads"]["edges"]
    assert [e["node"]["id"] for e in edges] == ids[:2]
    assert [e["toState"] for e in edges[0]["node"]["events"]][-1] == "queued"
    assert data["workloads"]["pageInfo"]["hasNextPage"] is True
    rest = gql(client, key, PAGE, first=2, after=data["workloads"]["pageInfo"]["endCursor"])
    assert [e["node"]["id"] for e in rest["data"]["workloads"]["edges"]] == ids[2:]
    # The same rows REST lists.
    listed = client.get("/v1/workloads", headers=auth(key)).json()["items"]
    assert [w["id"] for w in listed] == ids


def test_another_tenants_workloads_never_show(client, world):
    world.fleet(fleet(1))
    mine = world.key(world.tenant("acme", policy=ALL))
    theirs = world.key(world.tenant("globex", policy=ALL))
    [wid] = submit(client, theirs, 1)
    submit(client, mine, 1)
    body = gql(client, mine, PAGE, first=50)
    assert wid not in [e["node"]["id"] for e in body["data"]["workloads"]["edges"]]
    one = gql(client, mine, "query($id: ID!) { workload(id: $id) { id } }", id=wid)
    assert one["data"] is None and codes(one) == ["workload_not_found"]


def test_keys_and_scopes_are_checked_as_on_rest(client, world):
    world.fleet(fleet(1))
    op = world.key(None)
    assert codes(gql(client, None, "{ viewer { slug } }")) == ["missing_api_key"]
    # A key that is not one is refused at the door, as on REST (problem+json).
    r = client.post("/graphql", json={"query": "{ viewer { slug } }"}, headers=auth("rp_nope"))
    assert r.status_code == 401 and r.json()["code"] == "invalid_api_key"
    assert codes(gql(client, op, "{ workloads { edges { cursor } } }")) == ["tenant_key_required"]


def test_bad_arguments_are_named_with_rest_codes(client, world):
    key = world.key(world.tenant("acme", policy=ALL))
    body = gql(client, key, PAGE, first=501)
    assert codes(body) == ["validation_error"] and "first" in body["errors"][0]["message"]
    assert codes(gql(client, key, PAGE, first=5, state="sleeping")) == ["validation_error"]
    assert codes(gql(client, key, PAGE, first=5, after="!!")) == ["invalid_cursor"]


def test_limits_are_checked_before_execution(client, world):
    key = world.key(world.tenant("acme", policy=ALL))
    deep = "{ workloads { edges { node { events { details } placement { node } } } } }"
    assert "errors" not in gql(client, key, deep)
    nested = "{ a: viewer { slug } " + " ".join(f"b{i}: viewer {{ slug }}" for i in range(20)) + "}"
    body = gql(client, key, nested)
    assert body.get("data") is None and "aliases" in body["errors"][0]["message"]


@pytest.mark.parametrize("n", [10, 60])
def test_statements_do_not_grow_with_the_page(client, world, n, request):
    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    submit(client, key, n)
    count = [0]

    def on_execute(*_a, **_k):
        count[0] += 1

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        body = gql(client, key, PAGE, first=n)
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
    assert len(body["data"]["workloads"]["edges"]) == n
    # The page, the tenant and one statement for every workload's events, whatever n is.
    assert count[0] <= 4, count[0]
