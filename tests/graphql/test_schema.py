"""The portal's GraphQL API (`/graphql`): the same keys, services and tenancy scoping as REST,
REST's error codes, limits checked before execution, no N+1, and an SDL that matches the code."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from app.core.db import get_engine
from app.graphql.schema import schema
from tests.fixtures.graphql import codes, gql
from tests.fixtures.harness import ROOT
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth

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
    # (a worker of the suite may be placing it already)
    assert [e["toState"] for e in edges[0]["node"]["events"]][:2] == ["pending", "queued"]
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
    assert body.get("data") is None and codes(body) == ["too_many_aliases"]
    assert codes(gql(client, key, "{ viewer { slug }")) == ["graphql_syntax_error"]
    assert codes(gql(client, key, "{ viewer { nope } }")) == ["graphql_validation_failed"]
    # Cost: 500 workloads with their events and placements is past the budget, refused before
    # a row is read; the same page without events fits.
    big = "query($n: Int!) { workloads(first: $n) { edges { node { id events { seq reason at kind "
    big += "toState details } "
    big += "placement { node gpuIndices } } } } }"
    body = gql(client, key, big, n=500)
    assert codes(body) == ["query_too_costly"] and body.get("data") is None
    assert body["errors"][0]["extensions"]["cost"] > body["errors"][0]["extensions"]["limit"]
    assert "errors" not in gql(client, key, big, n=50)
    assert "errors" not in gql(client, key, "{ workloads(first: 500) { edges { node { id } } } }")
    # A variable left out costs its default.
    defaulted = big.replace("query($n: Int!)", "query($n: Int = 500)")
    assert codes(gql(client, key, defaulted)) == ["query_too_costly"]
    # The request's own mistakes are answers with a code, not internal errors.
    assert codes(gql(client, key, big, n="many")) == ["invalid_variables"]
    # (an over-large page is past the cost before its variable is coerced)
    assert codes(gql(client, key, big, n=3_000_000_000)) == ["query_too_costly"]
    assert codes(gql(client, key, "{ token }")) == ["graphql_validation_failed"]
    nul = gql(client, key, '{ workloads(labels: {team: "a\\u0000"}) { edges { cursor } } }')
    assert codes(nul) == ["validation_error"]
    # Fragments that each spread the next twice: 2^40 paths, each fragment measured once (the
    # limits once walked every path). Its cost is that many fields: refused, and answered.
    n = 40
    frags = " ".join(f"fragment F{i} on Query {{ ...F{i + 1} ...F{i + 1} }}" for i in range(n))
    frags += f" fragment F{n} on Query {{ viewer {{ slug }} }}"
    body = gql(client, key, "{ ...F0 } " + frags)
    assert codes(body) == ["query_too_costly"], body
    assert body["errors"][0]["extensions"]["cost"] == 2**n * 2
    schema_frags = " ".join(
        f"fragment T{i} on __Type {{ ofType {{ ...T{i + 1} ...T{i + 1} }} }}" for i in range(n)
    )
    schema_frags += f" fragment T{n} on __Type {{ name }}"
    body = gql(client, key, '{ __type(name: "Query") { ...T0 } } ' + schema_frags)
    assert "query_too_deep" in codes(body) and body.get("data") is None, body
    # The operation's own depth, through such fragments, as well.
    deep = " ".join(
        f"fragment D{i} on Query {{ viewer {{ ...D{i + 1} ...D{i + 1} }} }}" for i in range(n)
    )
    body = gql(client, key, "{ ...D0 } " + deep + f" fragment D{n} on Query {{ __typename }}")
    assert "query_too_deep" in codes(body), body


def test_the_depth_limit_refuses_before_execution(monkeypatch):
    from app.core.config import get_settings
    from app.graphql.schema import build_schema

    # The schema's deepest path is 6 (the fleet's holders), under the default of 10.
    monkeypatch.setattr(get_settings(), "graphql_max_depth", 3)
    shallow = build_schema()
    import asyncio

    got = asyncio.run(shallow.execute("{ nodes { edges { node { gpus { index } } } } }"))
    assert [e.extensions["code"] for e in got.errors] == ["query_too_deep"] and got.data is None


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


SUBMIT = """
mutation($input: WorkloadInput!) {
  submitWorkload(input: $input) {
    __typename
    ... on Workload { id state kind events { toState } }
    ... on Problem { code message }
    ... on ValidationProblem { fields { path message } }
  }
}
"""
TERMINATE = """
mutation($id: ID!) {
  terminateWorkload(id: $id) { __typename ... on Workload { state } ... on Problem { code } }
}
"""


def test_mutations_return_the_result_or_a_typed_error_with_rest_codes(client, world, session):
    from sqlalchemy import text

    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    other = world.key(world.tenant("globex", policy=ALL))
    op = world.key(None)
    r = gql(client, key, SUBMIT, input={"kind": "instance", "gpus": 1})["data"]["submitWorkload"]
    assert r["__typename"] == "Workload" and r["state"] == "queued"
    assert [e["toState"] for e in r["events"]][:2] == ["pending", "queued"]
    # Committed before the answer, and the same row REST reads (a worker may have placed it).
    got = client.get(f"/v1/workloads/{r['id']}", headers=auth(key)).json()
    assert got["id"] == r["id"] and got["kind"] == "instance"
    bad = gql(client, key, SUBMIT, input={"kind": "instance", "gpus": 99})["data"]
    bad = bad["submitWorkload"]
    assert bad["__typename"] == "ValidationProblem" and bad["code"] == "validation_error"
    assert ["input", "gpus"] in [f["path"] for f in bad["fields"]]
    none = gql(client, op, SUBMIT, input={"kind": "instance", "gpus": 1})["data"]
    assert none["submitWorkload"] == {
        "__typename": "ForbiddenProblem",
        "code": "tenant_key_required",
        "message": none["submitWorkload"]["message"],
    }
    # Another tenant's workload is not found; one's own is terminated.
    gone = gql(client, other, TERMINATE, id=r["id"])["data"]["terminateWorkload"]
    assert gone == {"__typename": "NotFoundProblem", "code": "workload_not_found"}
    done = gql(client, key, TERMINATE, id=r["id"])["data"]["terminateWorkload"]
    assert done == {"__typename": "Workload", "state": "terminated"}
    # Terminating again is idempotent, as on REST.
    assert gql(client, key, TERMINATE, id=r["id"])["data"]["terminateWorkload"] == done
    session.rollback()
    n = session.execute(text("SELECT count(*) FROM workloads")).scalar()
    assert n == 1  # nothing half-written by the refused ones


def test_a_mutation_is_in_the_audit_log_like_its_rest_route(client, world, session):
    from sqlalchemy import text

    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    gql(client, key, PAGE, first=5)  # a read is not an action
    r = gql(client, key, SUBMIT, input={"kind": "instance", "gpus": 1})["data"]["submitWorkload"]
    session.rollback()
    rows = session.execute(
        text("SELECT action, target_id, status FROM audit_log WHERE action LIKE '%graphql%'")
    ).all()
    assert [(a, s) for a, _t, s in rows] == [("POST /graphql:submitWorkload", 200)], rows
    assert r["__typename"] == "Workload"


FLEET = """
query($first: Int!) {
  nodes(first: $first) {
    edges { node { name rack region state health
                   gpus { index health perf holders { tenantId tier milli } } } }
    pageInfo { hasNextPage }
  }
}
"""


def _statements(client, key, query, **variables):
    count = [0]

    def on_execute(*_a, **_k):
        count[0] += 1

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        body = gql(client, key, query, **variables)
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
    return body, count[0]


def test_operators_read_the_fleet_with_its_holders_in_constant_statements(client, world):
    world.fleet(fleet(12))
    op = world.key(None)
    tenant = world.tenant("acme", policy=ALL)
    key = world.key(tenant)
    # Tenants may not.
    assert codes(gql(client, key, FLEET, first=5)) == ["platform_scope_required"]
    gql(client, op, FLEET, first=1)  # the key's lookup is cached after its first use
    small, n_small = _statements(client, op, FLEET, first=3)
    big, n_big = _statements(client, op, FLEET, first=12)
    assert len(small["data"]["nodes"]["edges"]) == 3 and len(big["data"]["nodes"]["edges"]) == 12
    assert n_small == n_big, (n_small, n_big)
    first = big["data"]["nodes"]["edges"][0]["node"]
    assert first["rack"] == "hgx-1" and first["region"] == "r1" and len(first["gpus"]) == 8
    assert all(g["holders"] == [] for g in first["gpus"])


def test_root_fields_run_on_the_thread_pool_not_the_event_loop(world, session, monkeypatch):
    """A slow service call must not stall the process's other requests: root fields (and
    loaders) do their database work off the event loop's thread, one at a time per context."""
    import asyncio
    import threading

    from app.fleet import service as fleet
    from app.graphql.context import Context
    from app.tenancy.principal import AuthContext

    seen: list[int] = []
    real = fleet.capacity

    def capacity(s):
        seen.append(threading.get_ident())
        return real(s)

    monkeypatch.setattr(fleet, "capacity", capacity)
    tenant = world.tenant("acme", policy=ALL)
    auth = AuthContext(tenant.id, "x", tenant.id, frozenset({"read"}), "active")

    async def main():
        ctx = Context(auth, session)
        got = await schema.execute(
            "{ a: capacity { region } b: capacity { region } }", context_value=ctx
        )
        return got, threading.get_ident()

    got, loop_thread = asyncio.run(main())
    assert got.errors is None and len(seen) == 2
    assert loop_thread not in seen
