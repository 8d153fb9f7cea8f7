"""The portal's account and operator fields answer what REST answers (one service, one response
model), mutations commit or leave nothing, input errors carry field paths, and an
Idempotency-Key replays a mutation's first answer instead of running it again."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from app.core.db import session_scope
from tests.fixtures.billing import post, usage_event
from tests.fixtures.graphql import gql
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth

T0 = datetime(2026, 10, 1, tzinfo=UTC)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def test_bills_and_usage_are_rests_answers_with_big_quantities_as_strings(client, world):
    op = world.key(None)
    acme = world.tenant("acme", policy=ALL)
    key = world.key(acme)
    base = {"gpu_model": "H100-80GB", "currency": "usd", "shape": "whole"}
    post(
        client,
        op,
        "/v1/admin/prices",
        {**base, "plan": "on_demand", "unit_amount": 250, "effective_from": T0.isoformat()},
    )
    # 512 GPUs for ten days: 4.4e14 milli-GPU-ms, far past GraphQL's 32-bit Int.
    start = datetime(2026, 11, 2, tzinfo=UTC)
    x = uuid.uuid4()
    events = [
        usage_event(acme, "a1", "start", start, x, milli=512_000),
        usage_event(acme, "a2", "stop", start + timedelta(days=10), x, milli=512_000),
    ]
    post(client, op, "/v1/admin/usage/events", {"events": events}, status=200)

    rest = client.get("/v1/billing/summary", params={"period": "2026-11"}, headers=auth(key))
    assert rest.status_code == 200
    body = gql(
        client,
        key,
        """{ bill(period: "2026-11") { period totals { currency amount } unpricedMilliGpuMs
              lines { sku milliGpuMs amount unitAmount priceVersion } } }""",
    )
    assert "errors" not in body, body
    bill, want = body["data"]["bill"], rest.json()
    # One money type: every amount a BigInt (a decimal string) with its currency.
    assert want["totals"] == {"usd": 512 * 240 * 250}
    assert bill["totals"] == [{"currency": "usd", "amount": str(512 * 240 * 250)}]
    assert [
        {
            **ln,
            "milliGpuMs": int(ln["milliGpuMs"]),
            "amount": int(ln["amount"]),
            "unitAmount": int(ln["unitAmount"]),
        }
        for ln in bill["lines"]
    ] == [
        {camel(k): ln[k] for k in ("sku", "milli_gpu_ms", "amount", "unit_amount", "price_version")}
        for ln in want["lines"]
    ]
    assert bill["lines"][0]["milliGpuMs"] == str(512_000 * 10 * 86_400_000)

    window = {"from": "2026-11-01T00:00:00Z", "to": "2026-12-01T00:00:00Z"}
    rest = client.get(
        "/v1/usage", params={**window, "group_by": "gpu_model"}, headers=auth(key)
    ).json()
    usage = gql(
        client,
        key,
        """query($from: DateTime!, $to: DateTime!) { usage(from: $from, to: $to,
             groupBy: [GPU_MODEL]) { granularity groupBy totalMilliGpuMs totalGpuHours
             rows { group milliGpuMs } } }""",
        **window,
    )["data"]["usage"]
    assert int(usage["totalMilliGpuMs"]) == rest["total_milli_gpu_ms"]
    assert usage["totalGpuHours"] == rest["total_gpu_hours"] == 512 * 240
    assert usage["groupBy"] == ["gpu_model"] and len(usage["rows"]) == len(rest["rows"]) == 10
    # Another tenant sees none of it; a naive time is refused with a field error.
    other = world.key(world.tenant("globex", policy=ALL))
    theirs = gql(client, other, '{ bill(period: "2026-11") { totals { amount } lines { sku } } }')
    assert theirs["data"]["bill"] == {"totals": [], "lines": []}
    naive = gql(
        client,
        key,
        '{ usage(from: "2026-11-01T00:00:00", to: "2026-11-02T00:00:00Z") { totalGpuHours } }',
    )
    assert naive["errors"][0]["extensions"]["code"] == "validation_error"


def test_keys_budget_and_checkpoints_commit_or_answer_a_typed_error(client, world):
    from app.models.keys import ApiKey

    world.fleet(fleet(1))
    acme = world.tenant("acme", policy=ALL)
    key = world.key(acme)
    made = gql(
        client,
        key,
        """mutation { createApiKey(input: {name: "ci", scopes: ["read"]}) {
             __typename ... on NewApiKey { id key scopes } ... on Problem { code } } }""",
    )["data"]["createApiKey"]
    assert made["__typename"] == "NewApiKey" and made["scopes"] == ["read"]
    assert gql(client, made["key"], "{ viewer { slug } }")["data"]["viewer"]["slug"] == "acme"
    # The new read-only key may not create keys: a typed error, and no key is written.
    with session_scope() as s:
        before = s.scalar(select(func.count()).select_from(ApiKey))
    refused = gql(
        client,
        made["key"],
        'mutation { createApiKey(input: {name: "x"}) { __typename ... on Problem { code } } }',
    )["data"]["createApiKey"]
    assert refused == {"__typename": "ForbiddenProblem", "code": "insufficient_scope"}
    bad = gql(
        client,
        key,
        """mutation { createApiKey(input: {name: "", scopes: ["root"]}) {
             __typename ... on ValidationProblem { code fields { path } } } }""",
    )["data"]["createApiKey"]
    assert bad["code"] == "validation_error"
    assert sorted(f["path"] for f in bad["fields"]) == [["input", "name"], ["input", "scopes", "0"]]
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(ApiKey)) == before
    revoked = gql(
        client,
        key,
        "mutation($id: ID!) { revokeApiKey(id: $id) { ... on ApiKey { revokedAt } } }",
        id=made["id"],
    )["data"]["revokeApiKey"]
    assert revoked["revokedAt"] is not None
    # A revoked key is refused before GraphQL runs, as on REST: 401 problem+json.
    r = client.post("/graphql", json={"query": "{ viewer { slug } }"}, headers=auth(made["key"]))
    assert r.status_code == 401 and r.json()["code"] == "revoked_api_key"

    assert gql(client, key, "{ budget { spent } }")["data"]["budget"] is None
    set_ = gql(
        client,
        key,
        """mutation { setBudget(input: {spendLimit: "50000000000", stopPreemptible: true}) {
             __typename ... on Budget { spendLimit stopPreemptible exhausted } } }""",
    )["data"]["setBudget"]
    assert set_ == {
        "__typename": "Budget",
        "spendLimit": "50000000000",
        "stopPreemptible": True,
        "exhausted": False,
    }
    rest = client.get("/v1/budget", headers=auth(key)).json()
    assert rest["spend_limit"] == 50_000_000_000 and rest["stop_preemptible"] is True
    # Money is an integer or its digits: never rounded on the way in.
    for bad in ("1.5", '"12x"', "true"):
        refused = gql(
            client, key, f"mutation {{ setBudget(input: {{spendLimit: {bad}}}) {{ __typename }} }}"
        )
        assert refused["errors"][0]["extensions"]["code"] == "graphql_validation_failed", bad
    none = gql(
        client, key, "mutation { setBudget(input: {}) { ... on ValidationProblem { message } } }"
    )["data"]["setBudget"]
    assert "spend_limit" in none["message"]
    assert gql(client, key, "mutation { removeBudget { __typename } }")["data"]["removeBudget"] == {
        "__typename": "Done"
    }
    assert client.get("/v1/budget", headers=auth(key)).status_code == 404
    again = gql(client, key, "mutation { removeBudget { ... on Problem { code } } }")
    assert again["data"]["removeBudget"] == {"code": "budget_not_found"}

    wid = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)
    ).json()["id"]
    early = gql(
        client,
        key,
        "mutation($id: ID!) { reportCheckpoint(id: $id, input: {sizeBytes: 10, completedAt: "
        '"2000-01-01T00:00:00Z"}) { __typename ... on Problem { code } '
        "... on WorkloadEvent { kind } } }",
        id=wid,
    )["data"]["reportCheckpoint"]
    # Queued: not running; running (the suite's worker placed it): before it started.
    assert early["code"] in ("workload_not_running", "checkpoint_before_start")
    naive = gql(
        client,
        key,
        'mutation($id: ID!) { reportCheckpoint(id: $id, input: {sizeBytes: "5000000000", '
        'completedAt: "2026-11-25T10:00:00"}) { ... on ValidationProblem { fields { path } } } }',
        id=wid,
    )["data"]["reportCheckpoint"]
    assert naive == {"fields": [{"path": ["input", "completedAt"]}]}


def test_a_mutation_sent_again_with_its_idempotency_key_is_not_run_again(client, world):
    from app.models.workloads import Workload

    world.fleet(fleet(1))
    acme = world.tenant("acme", policy=ALL)
    key = world.key(acme)
    q = 'mutation { submitWorkload(input: {kind: "instance", gpus: 1}) { ... on Workload { id } } }'
    headers = {**auth(key), "Idempotency-Key": "portal-submit-1"}
    first = client.post("/graphql", json={"query": q}, headers=headers)
    second = client.post("/graphql", json={"query": q}, headers=headers)
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert second.headers.get("Idempotent-Replayed") == "true"
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Workload)) == 1
    other = {"query": q.replace("gpus: 1", "gpus: 2")}
    assert client.post("/graphql", json=other, headers=headers).status_code == 409


def test_operators_read_the_fleet_and_change_quotas_and_nodes(client, world):
    world.fleet(fleet(2))
    acme = world.tenant("acme", policy=ALL)
    pending = world.tenant("newco", status="pending", policy=ALL)
    op = world.key(None)
    data = gql(
        client,
        op,
        """{ regions { edges { node { name } } } racks { edges { node { name kind } } }
             tenants(status: "pending") { edges { cursor node { slug } } pageInfo { hasNextPage } }
             capacity { region gpuModel totalGpus freeGpus } }""",
    )["data"]
    # Every list is a connection, as workloads and nodes are.
    [edge] = data["tenants"]["edges"]
    assert edge["node"] == {"slug": "newco"} and data["tenants"]["pageInfo"]["hasNextPage"] is False
    after = gql(
        client,
        op,
        "query($c: String) { tenants(after: $c) { edges { node { slug } } } }",
        c=edge["cursor"],
    )
    assert after["data"]["tenants"]["edges"] == []
    rest = client.get("/v1/capacity", headers=auth(world.key(acme))).json()["items"]
    assert data["capacity"] == [
        {camel(k): r[k] for k in ("region", "gpu_model", "total_gpus", "free_gpus")} for r in rest
    ]
    assert len(data["regions"]["edges"]) >= 1 and len(data["racks"]["edges"]) >= 1

    done = gql(
        client,
        op,
        """mutation($t: ID!) { setTenantQuotas(tenantId: $t, input: {quotas: [
             {gpuModel: "H100-80GB", guaranteedMilli: 2000, limitMilli: 4000}]}) {
             __typename ... on QuotaSetDone { quotas { gpuModel limitMilli } } } }""",
        t=str(acme.id),
    )["data"]["setTenantQuotas"]
    assert done["quotas"] == [{"gpuModel": "H100-80GB", "limitMilli": 4000}]
    assert (
        client.get(f"/v1/admin/tenants/{acme.id}/quotas", headers=auth(op)).json()["items"][0][
            "limit_milli"
        ]
        == 4000
    )
    bad = gql(
        client,
        op,
        """mutation($t: ID!) { setTenantQuotas(tenantId: $t, input: {quotas: [
             {gpuModel: "H100-80GB"}, {gpuModel: "H100-80GB"}]}) {
             ... on ValidationProblem { code } } }""",
        t=str(acme.id),
    )["data"]["setTenantQuotas"]
    assert bad == {"code": "validation_error"}

    approved = gql(
        client,
        op,
        "mutation($id: ID!) { approveTenant(id: $id) { ... on Tenant { status } } }",
        id=str(pending.id),
    )["data"]["approveTenant"]
    assert approved == {"status": "active"}

    node = client.get("/v1/admin/nodes", headers=auth(op)).json()["items"][0]
    moved = gql(
        client,
        op,
        """mutation($id: ID!) { setNodeState(id: $id, input: {state: "cordoned", reason: "bios"})
             { __typename ... on Node { state } ... on Problem { code } } }""",
        id=node["id"],
    )["data"]["setNodeState"]
    assert moved == {"__typename": "Node", "state": "cordoned"}
    wrong = gql(
        client,
        op,
        """mutation($id: ID!) { setNodeState(id: $id, input: {state: "flying"})
             { ... on ValidationProblem { fields { path } } } }""",
        id=node["id"],
    )["data"]["setNodeState"]
    assert wrong == {"fields": [{"path": ["input", "state"]}]}


def test_every_mutation_is_in_the_audit_log_once_refused_ones_too(client, world):
    from app.models.audit import AuditEntry

    acme = world.tenant("acme", policy=ALL)
    key, reader = world.key(acme), world.key(acme, scopes=("read",))
    two = """mutation { a: createApiKey(input: {name: "a"}) { ... on NewApiKey { id } }
                        b: createApiKey(input: {name: "b"}) { ... on NewApiKey { id } } }"""
    made = gql(client, key, two)["data"]
    refused = gql(client, reader, 'mutation { createApiKey(input: {name: "c"}) { __typename } }')
    assert refused["data"]["createApiKey"]["__typename"] == "ForbiddenProblem"
    with session_scope() as s:
        rows = s.scalars(
            select(AuditEntry)
            .where(AuditEntry.action == "POST /graphql:createApiKey")
            .order_by(AuditEntry.created_at)
        ).all()
        got = [(r.status, r.target_type, r.target_id, r.tenant_id) for r in rows]
    assert got == [
        (200, "api_key", made["a"]["id"], acme.id),
        (200, "api_key", made["b"]["id"], acme.id),
        (403, None, None, acme.id),
    ]


def test_workloads_filter_by_priority_and_labels_on_both_apis(client, world):
    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    made = {}
    for name, labels, priority in (
        ("a", {"team": "ml", "env": "prod"}, "training"),
        ("b", {"team": "ml"}, "research"),
        ("c", {"team": "web", "env": "prod"}, "training"),
    ):
        body = {"kind": "instance", "gpus": 1, "name": name, "labels": labels, "priority": priority}
        made[name] = client.post("/v1/workloads", json=body, headers=auth(key)).json()["id"]

    def rest(**params):
        r = client.get("/v1/workloads", params=params, headers=auth(key))
        assert r.status_code == 200, r.text
        return {w["name"] for w in r.json()["items"]}

    def graphql(args: str):
        q = f"{{ workloads({args}) {{ edges {{ node {{ name }} }} }} }}"
        return {e["node"]["name"] for e in gql(client, key, q)["data"]["workloads"]["edges"]}

    assert rest(label=["team=ml"]) == graphql('labels: {team: "ml"}') == {"a", "b"}
    assert (
        rest(label=["team=ml", "env=prod"]) == graphql('labels: {team: "ml", env: "prod"}') == {"a"}
    )
    assert rest(priority="training") == graphql('priority: "training"') == {"a", "c"}
    assert rest(label=["env=prod"], priority="research") == set()
    assert (
        client.get("/v1/workloads", params={"label": "team"}, headers=auth(key)).status_code == 422
    )
