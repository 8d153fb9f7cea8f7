"""GraphQL's access matrix, as tests/api/test_security_matrix.py is REST's: every root field has a
row saying who may use it, and a new field without one fails. Each row is checked for every
kind of caller: no key, a tenant key (read-only and read-write), another tenant's key, an
operator key. Nested fields are reachable only through their root, whose check covers them
(and whose loaders read through the tenant scope)."""

from __future__ import annotations

import uuid

import pytest

from app.graphql.schema import schema
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth

MISSING = "00000000-0000-4000-8000-000000000000"

# Root field -> (who, a query using it, the codes its owner may get besides success: a state
# that refuses the act, not an access refusal). Who: tenant-read | tenant-write | tenant-admin
# (a tenant key with that scope), reader (a tenant key with `read`, or an operator's), platform.
# Placeholders are the owning tenant's objects: {id} a workload, {key} an API key, {ssh} an
# SSH key, {tenant} the tenant; {node} a node (operators only); {pubkey} the SSH key's text.
P = "{ __typename ... on Problem { code } }"
WINDOW = 'from: "2026-01-01T00:00:00Z", to: "2026-01-02T00:00:00Z"'
MATRIX = {
    "viewer": ("tenant-read", "{ viewer { slug } }", ()),
    "workloads": (
        "tenant-read",
        '{ workloads(priority: "training", labels: {}) { edges { node { id events { seq } } } } }',
        (),
    ),
    "workload": ("tenant-read", 'query { workload(id: "{id}") { id placement { node } } }', ()),
    "apiKeys": ("tenant-read", "{ apiKeys { edges { node { id name prefix } } } }", ()),
    "quotas": ("tenant-read", "{ quotas { gpuModel usedMilli } }", ()),
    "capacity": ("reader", "{ capacity { region freeGpus freeMig } }", ()),
    "usage": ("reader", f"{{ usage({WINDOW}, groupBy: [GPU_MODEL]) {{ totalMilliGpuMs }} }}", ()),
    "bill": ("tenant-read", '{ bill(period: "2026-11") { totals { amount } lines { sku } } }', ()),
    "upcomingBill": ("tenant-read", "{ upcomingBill { totals { currency amount } } }", ()),
    "budget": ("tenant-read", "{ budget { spent alerts { metric } } }", ()),
    "commitments": ("tenant-read", "{ commitments { id gpusMilli } }", ()),
    "prices": ("reader", "{ prices { sku: shape unitAmount } }", ()),
    "dryRun": (
        "tenant-read",
        '{ dryRun(input: {kind: "instance", gpus: 1}) { placeableNow placement { node } } }',
        (),
    ),
    "submitWorkload": (
        "tenant-write",
        f'mutation {{ submitWorkload(input: {{kind: "instance", gpus: 1}}) {P} }}',
        (),
    ),
    "terminateWorkload": (
        "tenant-write",
        f'mutation {{ terminateWorkload(id: "{{id}}") {P} }}',
        (),
    ),
    "reportCheckpoint": (
        "tenant-write",
        f'mutation {{ reportCheckpoint(id: "{{id}}", input: {{sizeBytes: 1}}) {P} }}',
        ("workload_not_running",),
    ),
    "requestCheckpoint": (
        "tenant-write",
        f'mutation {{ requestCheckpoint(id: "{{id}}") {P} }}',
        ("workload_not_running",),
    ),
    "createApiKey": ("tenant-admin", f'mutation {{ createApiKey(input: {{name: "ci"}}) {P} }}', ()),
    "revokeApiKey": ("tenant-admin", f'mutation {{ revokeApiKey(id: "{{key}}") {P} }}', ()),
    "sshKeys": ("tenant-read", "{ sshKeys { edges { node { id name fingerprint } } } }", ()),
    "addSshKey": (
        "tenant-write",
        f'mutation {{ addSshKey(input: {{name: "m", publicKey: "{{pubkey}}"}}) {P} }}',
        ("ssh_key_exists",),
    ),
    "deleteSshKey": ("tenant-write", f'mutation {{ deleteSshKey(id: "{{ssh}}") {P} }}', ()),
    "secrets": ("tenant-read", "{ secrets { edges { node { name size version } } } }", ()),
    "putSecret": (
        "tenant-write",
        f'mutation {{ putSecret(input: {{name: "m", value: "v"}}) {P} }}',
        (),
    ),
    "deleteSecret": (
        "tenant-write",
        f'mutation {{ deleteSecret(name: "m") {P} }}',
        ("secret_not_found",),
    ),
    "volumes": ("tenant-read", "{ volumes { edges { node { name storage } } } }", ()),
    "putVolume": (
        "tenant-write",
        f'mutation {{ putVolume(input: {{name: "m", storage: "node"}}) {P} }}',
        (),
    ),
    "deleteVolume": (
        "tenant-write",
        f'mutation {{ deleteVolume(name: "m") {P} }}',
        ("volume_not_found",),
    ),
    "endpoints": ("tenant-read", "{ endpoints { edges { node { name target } } } }", ()),
    "endpoint": ("tenant-read", '{ endpoint(name: "m") { name } }', ("endpoint_not_found",)),
    "endpointEvents": (
        "tenant-read",
        '{ endpointEvents(name: "m") { kind } }',
        ("endpoint_not_found",),
    ),
    "createEndpoint": (
        "tenant-write",
        f'mutation {{ createEndpoint(input: {{name: "m", replica: {{gpus: 1}}}}) {P} }}',
        (),
    ),
    "updateEndpoint": (
        "tenant-write",
        f'mutation {{ updateEndpoint(name: "m", input: {{maxReplicas: 2}}) {P} }}',
        ("endpoint_not_found",),
    ),
    "deleteEndpoint": (
        "tenant-write",
        f'mutation {{ deleteEndpoint(name: "m") {P} }}',
        ("endpoint_not_found",),
    ),
    "setBudget": ("tenant-write", f"mutation {{ setBudget(input: {{spendLimit: 100}}) {P} }}", ()),
    "removeBudget": ("tenant-write", f"mutation {{ removeBudget {P} }}", ("budget_not_found",)),
    # Operators
    "nodes": (
        "platform",
        "{ nodes { edges { node { name gpus { holders { tenantId } } } } } }",
        (),
    ),
    "regions": ("platform", "{ regions { edges { node { name } } } }", ()),
    "racks": ("platform", "{ racks { edges { node { name kind } } } }", ()),
    "tenants": ("platform", '{ tenants(status: "active") { edges { node { slug } } } }', ()),
    "tenantQuotas": ("platform", '{ tenantQuotas(tenantId: "{tenant}") { gpuModel } }', ()),
    "utilisation": ("platform", f"{{ utilisation({WINDOW}) {{ utilisationPct }} }}", ()),
    "fleetHealth": ("platform", "{ fleetHealth { __typename } }", ()),
    "idleTime": ("platform", f"{{ idleTime({WINDOW}) {{ totals {{ cause }} }} }}", ()),
    "fleetMap": ("platform", "{ fleetMap { gpus nodes racks { name } } }", ()),
    "fleetImport": (
        "platform",
        f'{{ fleetImport(id: "{MISSING}") {{ status }} }}',
        ("fleet_import_not_found",),
    ),
    "reconciliation": ("platform", '{ reconciliation(period: "2026-11") { differences } }', ()),
    "setNodeState": (
        "platform",
        f'mutation {{ setNodeState(id: "{{node}}", input: {{state: "cordoned"}}) {P} }}',
        (),
    ),
    "setTenantQuotas": (
        "platform",
        f'mutation {{ setTenantQuotas(tenantId: "{{tenant}}", input: {{quotas: []}}) {P} }}',
        (),
    ),
    "approveTenant": (
        "platform",
        f'mutation {{ approveTenant(id: "{{tenant}}") {P} }}',
        ("tenant_not_pending",),
    ),
    "tenant": ("platform", '{ tenant(id: "{tenant}") { slug status isolationPolicy } }', ()),
    "suspendTenant": ("platform", f'mutation {{ suspendTenant(id: "{{tenant}}") {P} }}', ()),
    "reactivateTenant": (
        "platform",
        f'mutation {{ reactivateTenant(id: "{{tenant}}") {P} }}',
        ("tenant_not_suspended",),
    ),
    "updateTenant": (
        "platform",
        f'mutation {{ updateTenant(id: "{{tenant}}", input: {{isolationPolicy: ["vm"]}}) {P} }}',
        (),
    ),
    "createPrice": (
        "platform",
        'mutation { createPrice(input: {gpuModel: "H100-80GB", shape: "whole", '
        'plan: "on_demand", currency: "usd", unitAmount: 250, '
        f'effectiveFrom: "2026-01-01T00:00:00Z"}}) {P} }}',
        (),
    ),
    "setNodeHealth": (
        "platform",
        f'mutation {{ setNodeHealth(id: "{{node}}", input: {{action: "release"}}) {P} }}',
        (),
    ),
    "setGpuHealth": (
        "platform",
        f'mutation {{ setGpuHealth(nodeId: "{{node}}", gpuIndex: 0, input: {{action: "release"}}) '
        f"{P} }}",
        (),
    ),
    "chaosExperiments": (
        "platform",
        '{ chaosExperiments(state: "running") { edges { node { id state gpusTouched } } } }',
        (),
    ),
    "chaosExperiment": (
        "platform",
        f'{{ chaosExperiment(id: "{MISSING}") {{ held report {{ detectS }} }} }}',
        ("experiment_not_found",),
    ),
    "softwareStacks": ("platform", "{ softwareStacks { name components nodes drifted } }", ()),
    "createStack": (
        "platform",
        'mutation { createStack(input: {name: "m", components: {driver: "1.0", cuda: "12.6"}}) '
        f"{P} }}",
        ("stack_exists",),
    ),
    "assignStack": (
        "platform",
        f'mutation {{ assignStack(name: "nope", input: {{pool: "p"}}) {P} }}',
        ("stack_not_found",),
    ),
    "bringUp": ("platform", "{ bringUp { stuck items { node why stuck } } }", ()),
    "setMigLayout": (
        "platform",
        f'mutation {{ setMigLayout(gpuId: "{MISSING}", input: {{profiles: ["3g"]}}) {P} }}',
        ("gpu_not_found",),
    ),
    "upgrades": ("platform", "{ upgrades { id state progress { pending } } }", ()),
    "upgrade": (
        "platform",
        f'{{ upgrade(id: "{MISSING}") {{ state report {{ gpuHoursOutOfService }} }} }}',
        ("upgrade_not_found",),
    ),
    "startUpgrade": (
        "platform",
        f'mutation {{ startUpgrade(input: {{stack: "nope", pool: "p"}}) {P} }}',
        ("stack_not_found",),
    ),
    "resumeUpgrade": (
        "platform",
        f'mutation {{ resumeUpgrade(id: "{MISSING}") {P} }}',
        ("upgrade_not_found",),
    ),
    "rollbackUpgrade": (
        "platform",
        f'mutation {{ rollbackUpgrade(id: "{MISSING}") {P} }}',
        ("upgrade_not_found",),
    ),
    "stopChaosExperiment": (
        "platform",
        f'mutation {{ stopChaosExperiment(id: "{MISSING}") {P} }}',
        ("experiment_not_found",),
    ),
    # Subscriptions (over graphql-transport-ws: `run` answers with the first message)
    "workloadEvents": (
        "reader",
        'subscription { workloadEvents(after: "0", workloadId: "{id}") { cursor workloadId } }',
        (),
    ),
    "fleetChanges": ("platform", 'subscription { fleetChanges(after: "0") { cursor } }', ()),
    "workloadLogs": (
        "reader",
        'subscription { workloadLogs(workloadId: "{id}") { id workloadId data } }',
        (),
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
    from cryptography.hazmat.primitives import serialization as openssh
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from sqlalchemy import select

    from app.core.db import session_scope, utcnow
    from app.keys.service import create_key
    from app.keys.ssh_keys import add_ssh_key
    from app.models.fleet import Node
    from app.models.logs import WorkloadLog

    world.fleet(fleet(1))
    acme = world.tenant("acme", policy=ALL)
    keys = {
        "acme": world.key(acme),
        "acme-rw": world.key(acme, scopes=("read", "write")),
        "acme-read": world.key(acme, scopes=("read",)),
        "globex": world.key(world.tenant("globex", policy=ALL)),
        "operator": world.key(None),
    }
    with session_scope() as s:
        spare = create_key(s, tenant_id=acme.id, name="spare", scopes=["read"]).id
        node = s.scalars(select(Node.id)).first()
        pubkey = (
            ed25519.Ed25519PrivateKey.generate()
            .public_key()
            .public_bytes(openssh.Encoding.OpenSSH, openssh.PublicFormat.OpenSSH)
            .decode()
        )
        ssh = add_ssh_key(s, tenant_id=acme.id, name="laptop", public_key=pubkey).id
    for action in ("quarantine", "release"):  # a health change for fleetChanges to replay
        client.post(
            f"/v1/admin/nodes/{node}/health",
            json={"action": action},
            headers=auth(keys["operator"]),
        ).raise_for_status()
    wid = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(keys["acme"])
    ).json()["id"]
    with session_scope() as s:  # a line of its output, for workloadLogs to replay
        s.add(
            WorkloadLog(
                workload_id=uuid.UUID(wid),
                tenant_id=acme.id,
                attempt=1,
                replica=0,
                offset=0,
                data="hello\n",
                bytes=6,
                at=utcnow(),
            )
        )
    objects = {
        "{id}": wid,
        "{key}": str(spare),
        "{ssh}": str(ssh),
        "{tenant}": str(acme.id),
        "{node}": str(node),
        "{pubkey}": pubkey,
    }
    return keys, objects


def fill(query: str, objects: dict[str, str]) -> str:
    for mark, value in objects.items():
        query = query.replace(mark, value)
    return query


def run(client, key, query):
    if query.startswith("subscription"):
        return first_answer(client, key, query)
    r = client.post("/graphql", json={"query": query}, headers=auth(key) if key else {})
    assert r.status_code == 200, r.text
    return r.json()


def first_answer(client, key, query):
    """A subscription's first message over graphql-transport-ws, as a body: the error it was
    refused with, or its first item (every caller allowed has one to replay: `after: "0"`)."""
    with client.websocket_connect("/graphql", subprotocols=["graphql-transport-ws"]) as ws:
        ws.send_json({"type": "connection_init", "payload": auth(key) if key else {}})
        assert ws.receive_json()["type"] == "connection_ack"
        ws.send_json({"id": "1", "type": "subscribe", "payload": {"query": query}})
        msg = ws.receive_json()
    assert msg["type"] in ("next", "error"), msg
    return {"errors": msg["payload"]} if msg["type"] == "error" else msg["payload"]


def refusal(body) -> str | None:
    """The code a caller was refused with: a GraphQL error's, or a typed problem's."""
    if body.get("errors"):
        return body["errors"][0]["extensions"]["code"]
    value = next(iter((body.get("data") or {}).values()))
    if isinstance(value, dict) and value.get("__typename", "").endswith("Problem"):
        return value["code"]
    return None


NOT_FOUND = {
    "{id}": "workload_not_found",
    "{key}": "key_not_found",
    "{ssh}": "ssh_key_not_found",
    "{tenant}": "tenant_not_found",
}


@pytest.mark.parametrize("field", sorted(MATRIX))
def test_who_may_use_each_field(client, callers, field):
    keys, objects = callers
    who, query, fine = MATRIX[field]
    q = fill(query, objects)
    assert refusal(run(client, None, q)) == "missing_api_key"
    if who == "platform":
        assert refusal(run(client, keys["acme"], q)) == "platform_scope_required"
        assert refusal(run(client, keys["operator"], q)) in (None, *fine)
        return
    if who == "reader":
        assert refusal(run(client, keys["operator"], q)) in (None, *fine)
    else:
        assert refusal(run(client, keys["operator"], q)) == "tenant_key_required"
    if who in ("tenant-write", "tenant-admin"):
        assert refusal(run(client, keys["acme-read"], q)) == "insufficient_scope"
    if who == "tenant-admin":
        assert refusal(run(client, keys["acme-rw"], q)) == "insufficient_scope"
    # The owner may; another tenant gets nothing of the owner's: the owner's objects named in
    # an argument are not found for it, and no answer carries the owner's ids.
    marks = [m for m in NOT_FOUND if m in query]
    for mark in marks:
        assert refusal(run(client, keys["globex"], q)) == NOT_FOUND[mark]
        missing = query.replace(mark, MISSING)
        assert refusal(run(client, keys["acme"], fill(missing, objects))) == NOT_FOUND[mark]
    if not marks:
        body = run(client, keys["globex"], q)
        assert objects["{id}"] not in str(body) and objects["{tenant}"] not in str(body)
    assert refusal(run(client, keys["acme"], q)) in (None, *fine)
