"""The operator's actions through GraphQL (what the portal's operator pages send), each once,
against PostgreSQL, its effect read back through REST, and one audit entry per mutation:
tenants (suspend, reactivate, isolation policy), price versions, a GPU's and a node's health,
node states (cordon, drain, down), chaos experiments (list, report, stop). And the REST custom
methods `:suspend` and `:reactivate`."""

from __future__ import annotations

import pytest

from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth

P = "__typename ... on Problem { code }"
TENANT = f"... on Tenant {{ id status isolationPolicy }} {P}"


def gql(client, key, query, headers=None, **variables):
    r = client.post(
        "/graphql",
        json={"query": query, "variables": variables},
        headers={**auth(key), **(headers or {})},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert not body.get("errors"), body
    return next(iter(body["data"].values()))


def audited(client, op) -> list[tuple[str, int, str | None, str | None]]:
    """GraphQL's entries in the audit log, oldest first: (mutation, status, target)."""
    r = client.get("/v1/admin/audit", params={"limit": 500}, headers=auth(op))
    assert r.status_code == 200, r.text
    return [
        (e["action"].removeprefix("POST /graphql:"), e["status"], e["target_type"], e["target_id"])
        for e in r.json()["items"]
        if e["action"].startswith("POST /graphql:")
    ]


@pytest.fixture
def ops(client, world):
    world.fleet(fleet(1))
    acme = world.tenant("acme", policy=ALL)
    return world.key(acme), world.key(None), str(acme.id)


def test_suspend_reactivate_and_isolation_policy(client, ops):
    key, op, tid = ops
    suspend = f"mutation($id: ID!) {{ suspendTenant(id: $id) {{ {TENANT} }} }}"
    reactivate = f"mutation($id: ID!) {{ reactivateTenant(id: $id) {{ {TENANT} }} }}"
    update = (
        "mutation($id: ID!, $input: TenantUpdateInput!) "
        f"{{ updateTenant(id: $id, input: $input) {{ {TENANT} ... on ValidationProblem {{ "
        "fields { path } } } }"
    )
    assert client.post("/v1/keys", json={"name": "a"}, headers=auth(key)).status_code == 201

    done = gql(client, op, suspend, id=tid)
    assert done["__typename"] == "Tenant" and done["status"] == "suspended"
    # Its key: refused on a write (and any other read), but it may still read itself.
    r = client.post("/v1/keys", json={"name": "b"}, headers=auth(key))
    assert r.status_code == 403 and r.json()["code"] == "tenant_not_active"
    assert "reactivate" in r.json()["detail"]
    assert client.get("/v1/workloads", headers=auth(key)).status_code == 403
    me = client.get("/v1/tenant", headers=auth(key))
    assert me.status_code == 200 and me.json()["status"] == "suspended"
    again = gql(client, op, suspend, id=tid)
    assert again == {"__typename": "ConflictProblem", "code": "tenant_not_active"}

    done = gql(client, op, reactivate, id=tid)
    assert done["__typename"] == "Tenant" and done["status"] == "active"
    assert client.post("/v1/keys", json={"name": "c"}, headers=auth(key)).status_code == 201
    again = gql(client, op, reactivate, id=tid)
    assert again == {"__typename": "ConflictProblem", "code": "tenant_not_suspended"}

    done = gql(client, op, update, id=tid, input={"isolationPolicy": ["vm", "dedicated-gpu"]})
    assert done["isolationPolicy"] == ["vm", "dedicated-gpu"]
    read = client.get(f"/v1/admin/tenants/{tid}", headers=auth(op)).json()
    assert read["isolation_policy"] == ["vm", "dedicated-gpu"] and read["status"] == "active"
    bad = gql(client, op, update, id=tid, input={"isolationPolicy": ["gold"]})
    assert bad["__typename"] == "ValidationProblem" and bad["code"] == "validation_error"
    assert ["input", "isolationPolicy", "0"] in [f["path"] for f in bad["fields"]]
    back = gql(client, op, update, id=tid, input={"status": "pending"})
    assert back == {"__typename": "ConflictProblem", "code": "tenant_status_refused"}
    # The policy counts for the tenant's next submission (a shared tier is now refused).
    r = client.post(
        "/v1/workloads",
        json={"kind": "instance", "milli": 100, "gpu_memory_mib": 1024},
        headers=auth(key),
    )
    assert r.status_code == 422, r.text
    assert (r.json()["code"], r.json()["rule"]) == (
        "isolation_rule_violated",
        "tier_forbidden_by_tenant_policy",
    )
    # A tenant key may do none of it.
    assert gql(client, key, suspend, id=tid)["code"] == "platform_scope_required"

    t = ("tenant", tid)
    assert audited(client, op) == [
        ("suspendTenant", 200, *t),
        ("suspendTenant", 409, None, None),
        ("reactivateTenant", 200, *t),
        ("reactivateTenant", 409, None, None),
        ("updateTenant", 200, *t),
        ("updateTenant", 422, None, None),
        ("updateTenant", 409, None, None),
        ("suspendTenant", 403, None, None),
    ]


def test_suspend_and_reactivate_through_rest(client, world):
    t = world.tenant("acme", policy=ALL)
    key, op, tid = world.key(t), world.key(None), str(t.id)
    r = client.post(f"/v1/admin/tenants/{tid}:suspend", headers=auth(op))
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    r = client.post("/v1/keys", json={"name": "x"}, headers=auth(key))
    assert r.status_code == 403 and r.json()["code"] == "tenant_not_active"
    assert client.get("/v1/tenant", headers=auth(key)).json()["status"] == "suspended"
    r = client.post(f"/v1/admin/tenants/{tid}:suspend", headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "tenant_not_active"
    r = client.post(f"/v1/admin/tenants/{tid}:reactivate", headers=auth(op))
    assert r.status_code == 200 and r.json()["status"] == "active"
    assert client.post("/v1/keys", json={"name": "x"}, headers=auth(key)).status_code == 201
    r = client.post(f"/v1/admin/tenants/{tid}:reactivate", headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "tenant_not_suspended"
    r = client.post(f"/v1/admin/tenants/{tid}:suspend", headers=auth(key))
    assert r.status_code == 403 and r.json()["code"] == "platform_scope_required"
    # A pending tenant is approved, not suspended or reactivated; PATCH moves by the same rules.
    p = str(world.tenant("newco", status="pending").id)
    r = client.post(f"/v1/admin/tenants/{p}:suspend", headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "tenant_not_active"
    r = client.post(f"/v1/admin/tenants/{p}:reactivate", headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "tenant_not_suspended"
    r = client.patch(f"/v1/admin/tenants/{p}", json={"status": "active"}, headers=auth(op))
    assert r.status_code == 200 and r.json()["status"] == "active"  # approved
    r = client.patch(f"/v1/admin/tenants/{p}", json={"status": "pending"}, headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "tenant_status_refused"
    r = client.patch(f"/v1/admin/tenants/{p}", json={"status": "active"}, headers=auth(op))
    assert r.status_code == 200  # no change
    entries = client.get(
        "/v1/admin/audit", params={"target_id": tid, "target_type": "tenant"}, headers=auth(op)
    ).json()["items"]
    assert [(e["action"], e["status"]) for e in entries if e["status"] == 200] == [
        ("POST /v1/admin/tenants/{tenant_id}:suspend", 200),
        ("POST /v1/admin/tenants/{tenant_id}:reactivate", 200),
    ]


def test_a_price_version_is_created_and_listed(client, ops):
    _key, op, _tid = ops
    create = (
        f"mutation($input: PriceInput!) {{ createPrice(input: $input) {{ {P} "
        "... on Price { id version unitAmount currency } } }"
    )
    price = {
        "gpuModel": "H100-80GB",
        "shape": "whole",
        "plan": "on_demand",
        "currency": "usd",
        "unitAmount": 399,
        "effectiveFrom": "2026-01-01T00:00:00Z",
    }
    one = gql(client, op, create, input=price)
    assert one["__typename"] == "Price" and one["version"] == 1 and one["unitAmount"] == "399"
    # Idempotency-Key: the same request again is the first answer, nothing created twice.
    key = {"Idempotency-Key": "price-2"}
    two = gql(client, op, create, headers=key, input={**price, "unitAmount": 450})
    assert gql(client, op, create, headers=key, input={**price, "unitAmount": 450}) == two
    assert two["version"] == 2
    bad = gql(client, op, create, input={**price, "currency": "USD"})
    assert bad == {"__typename": "ValidationProblem", "code": "validation_error"}
    listed = client.get("/v1/admin/prices", headers=auth(op)).json()["items"]
    assert [(p["version"], p["unit_amount"]) for p in listed] == [(1, 399), (2, 450)]
    assert [p["id"] for p in listed] == [one["id"], two["id"]]
    assert audited(client, op) == [
        ("createPrice", 200, "price", one["id"]),
        ("createPrice", 200, "price", two["id"]),
        ("createPrice", 422, None, None),
    ]


def _node(client, op):
    [n] = client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]
    return n["id"]


def _gpu_health(client, op, node, index):
    detail = client.get(f"/v1/admin/nodes/{node}", headers=auth(op)).json()
    return next(g["health"] for g in detail["gpus"] if g["index"] == index)


def test_release_a_gpu_and_a_nodes_health(client, ops):
    _key, op, _tid = ops
    node = _node(client, op)
    gpus = client.get("/v1/admin/gpus", params={"node_id": node}, headers=auth(op)).json()
    gpu3 = next(g["id"] for g in gpus["items"] if g["index"] == 3)
    r = client.post(
        f"/v1/admin/gpus/{gpu3}/health", json={"action": "quarantine"}, headers=auth(op)
    )
    assert r.status_code == 200 and _gpu_health(client, op, node, 3) == "quarantined"
    gpu = (
        "mutation($node: ID!, $i: Int!, $input: HealthActionInput!) { "
        f"setGpuHealth(nodeId: $node, gpuIndex: $i, input: $input) {{ {P} "
        "... on HealthAction { nodeId gpuIndex health } } }"
    )
    done = gql(client, op, gpu, node=node, i=3, input={"action": "release", "reason": "reseated"})
    assert done == {
        "__typename": "HealthAction",
        "nodeId": node,
        "gpuIndex": 3,
        "health": "healthy",
    }
    assert _gpu_health(client, op, node, 3) == "healthy"
    hist = client.get(
        f"/v1/admin/nodes/{node}/health-events", params={"gpu_index": 3}, headers=auth(op)
    ).json()["items"]
    assert hist[0]["to_state"] == "healthy" and hist[0]["actor"] == "operator"
    assert "reseated" in hist[0]["cause"]
    none = gql(client, op, gpu, node=node, i=42, input={"action": "release"})
    assert none == {"__typename": "NotFoundProblem", "code": "gpu_not_found"}
    missing = "00000000-0000-4000-8000-000000000000"
    gone = gql(client, op, gpu, node=missing, i=0, input={"action": "release"})
    assert gone == {"__typename": "NotFoundProblem", "code": "node_not_found"}
    whole = (
        "mutation($id: ID!, $input: HealthActionInput!) { "
        f"setNodeHealth(id: $id, input: $input) {{ {P} ... on HealthAction {{ health }} }} }}"
    )
    assert gql(client, op, whole, id=node, input={"action": "quarantine"})["health"] == (
        "quarantined"
    )
    r = client.get(f"/v1/admin/nodes/{node}", headers=auth(op)).json()
    assert r["health"] == "quarantined"
    assert gql(client, op, whole, id=node, input={"action": "release"})["health"] == "healthy"
    assert client.get(f"/v1/admin/nodes/{node}", headers=auth(op)).json()["health"] == "healthy"
    assert audited(client, op) == [
        ("setGpuHealth", 200, "gpu_health", gpu3),
        ("setGpuHealth", 404, None, None),
        ("setGpuHealth", 404, None, None),
        ("setNodeHealth", 200, "node_health", node),
        ("setNodeHealth", 200, "node_health", node),
    ]


def test_cordon_drain_and_mark_a_node_down(client, ops):
    _key, op, _tid = ops
    node = _node(client, op)
    change = (
        "mutation($id: ID!, $input: NodeStateInput!) { "
        f"setNodeState(id: $id, input: $input) {{ {P} ... on Node {{ state }} }} }}"
    )
    for state in ("cordoned", "draining", "down"):
        done = gql(client, op, change, id=node, input={"state": state, "reason": "maintenance"})
        assert done == {"__typename": "Node", "state": state}
        read = client.get(f"/v1/admin/nodes/{node}", headers=auth(op)).json()
        assert (read["state"], read["state_reason"]) == (state, "maintenance")
    refused = gql(client, op, change, id=node, input={"state": "draining"})
    assert refused == {"__typename": "ConflictProblem", "code": "invalid_state_transition"}
    assert audited(client, op) == [
        *[("setNodeState", 200, "node_state", node)] * 3,
        ("setNodeState", 409, None, None),
    ]


def test_chaos_experiments_are_listed_reported_and_stopped(client, ops):
    _key, op, _tid = ops
    # An application error (Xid 13): injected through telemetry, takes nothing out.
    r = client.post(
        "/v1/admin/chaos/experiments",
        json={
            "name": "game day",
            "faults": [{"kind": "xid", "code": 13, "target": {"node": "h1", "gpu": 2}}],
            "blast_radius": {"max_gpus": 1, "max_region_share": 1},
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    exp = r.json()["id"]
    listing = (
        "query($state: String) { chaosExperiments(state: $state) { "
        "edges { node { id name state gpusTouched } } pageInfo { hasNextPage } } }"
    )
    running = gql(client, op, listing, state="running")
    assert [e["node"] for e in running["edges"]] == [
        {"id": exp, "name": "game day", "state": "running", "gpusTouched": 1}
    ]
    assert gql(client, op, listing, state="stopped")["edges"] == []
    report = (
        "query($id: ID!) { chaosExperiment(id: $id) { id state held "
        "injections { node gpuIndex code undoneAt } report { node gpuIndex } "
        "invariants { doubleAllocations } } }"
    )
    got = gql(client, op, report, id=exp)
    assert got["state"] == "running" and got["held"] is True
    assert got["injections"] == [{"node": "h1", "gpuIndex": 2, "code": 13, "undoneAt": None}]
    assert got["report"] == [{"node": "h1", "gpuIndex": 2}]
    stop = (
        "mutation($id: ID!) { stopChaosExperiment(id: $id) { "
        f"{P} ... on ChaosExperiment {{ state injections {{ undoneAt }} }} }} }}"
    )
    done = gql(client, op, stop, id=exp)
    assert done["__typename"] == "ChaosExperiment" and done["state"] == "stopped"
    assert done["injections"][0]["undoneAt"] is not None
    rest = client.get(f"/v1/admin/chaos/experiments/{exp}", headers=auth(op)).json()
    assert rest["state"] == "stopped" and rest["injections"][0]["undone_at"] is not None
    listed = client.get(
        "/v1/admin/chaos/experiments", params={"state": "stopped"}, headers=auth(op)
    )
    assert [x["id"] for x in listed.json()["items"]] == [exp]
    assert [e["node"]["id"] for e in gql(client, op, listing, state="stopped")["edges"]] == [exp]
    assert gql(client, op, stop, id=exp)["state"] == "stopped"  # stopping again: no change
    r = client.post(
        "/graphql",
        json={"query": '{ chaosExperiments(state: "gone") { edges { cursor } } }'},
        headers=auth(op),
    )
    assert r.json()["errors"][0]["extensions"]["code"] == "validation_error"
    assert audited(client, op) == [("stopChaosExperiment", 200, "chaos_experiment", exp)] * 2
