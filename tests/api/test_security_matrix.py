"""Walk every route of the OpenAPI document and check authentication and tenant isolation.

New routes join automatically; a route whose path parameter has no fixture below fails the
test until one is added, so nobody can add an unchecked route by accident.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest

from tests.fixtures.world import SMALL_FLEET, auth

PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/v1/signup"),
    ("POST", "/v1/sessions"),
    ("POST", "/v1/agent/join"),  # a join token in the body is its credential (test_agents_join)
}
# Valid bodies for tenant routes that have both a path parameter and a body, so the 404 (not a
# 422) is what the other tenant sees.
BODIES: dict[tuple[str, str], dict] = {
    ("POST", "/v1/workloads/{workload_id}/checkpoints"): {"size_bytes": 1},
    ("POST", "/v1/workloads/{workload_id}/progress"): {
        "ranks": [{"rank": 0, "step_time_s": 1.0}, {"rank": 1, "step_time_s": 1.0}]
    },
}
BODIES[("PUT", "/v1/secrets/{secret_name}")] = {"value": "b's secret"}
BODIES[("PUT", "/v1/volumes/{volume_name}")] = {"storage": "node"}
BODIES[("PATCH", "/v1/endpoints/{endpoint_name}")] = {"max_replicas": 2}
# Routes that create the caller's own object under a name: another tenant's call makes its
# own, and must leave the first tenant's untouched (checked instead of a 404).
BY_NAME = {("PUT", "/v1/secrets/{secret_name}"), ("PUT", "/v1/volumes/{volume_name}")}
# Required query parameters of tenant list routes (grouped so that any of A's ids would show).
QUERIES: dict[tuple[str, str], dict] = {
    ("GET", "/v1/usage"): {
        "from": "2026-01-01T00:00:00Z",
        "to": "2027-01-01T00:00:00Z",
        "group_by": "tenant_id,workload_id",
    },
}
WINDOW = {"from": "2026-01-01T00:00:00Z", "to": "2027-01-01T00:00:00Z"}
QUERIES[("GET", "/v1/admin/utilisation")] = WINDOW
QUERIES[("GET", "/v1/admin/idle-time")] = WINDOW
QUERIES[("GET", "/v1/billing/summary")] = {"period": "2026-06"}  # A's usage starts then
QUERIES[("GET", "/v1/billing/exports")] = {"period": "2026-06", "format": "csv"}
QUERIES[("GET", "/v1/admin/billing/reconciliation")] = {"period": "2026-06"}


@pytest.fixture
def matrix(world, client, session):
    from sqlalchemy import select

    from app.models.fleet import Gpu, Node, Rack, Region
    from app.models.keys import ApiKey

    world.fleet(SMALL_FLEET)
    a = world.tenant("tenant-a")
    b = world.tenant("tenant-b")
    a_key = world.key(a)
    b_key = world.key(b)
    op_key = world.key(None)
    revoked = world.key(a, name="revoked")
    revoked_op = world.key(None, name="revoked-op")
    for k in (revoked, revoked_op):
        client.delete(f"/v1/admin/keys/{_key_id(session, k)}", headers=auth(op_key))
    r = client.post(
        "/v1/admin/fleet:import",
        content="regions: [{name: r9, racks: []}]",
        headers={**auth(op_key), "content-type": "application/yaml"},
    )
    assert r.status_code == 202, r.text
    node = session.scalar(select(Node).limit(1))
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(a_key))
    assert w.status_code == 201, w.text
    # Tenant A has usage on record (as the placement worker would have written it).
    ingested = client.post(
        "/v1/admin/usage/events",
        json={
            "events": [
                {
                    "event_key": f"matrix:{w.json()['id']}:start",
                    "kind": "start",
                    "allocation_id": w.json()["id"],
                    "workload_id": w.json()["id"],
                    "tenant_id": str(a.id),
                    "region": "r1",
                    "gpu_model": "H100-80GB",
                    "shape": "whole",
                    "tier": "dedicated-gpu",
                    "priority": "training",
                    "gpu_milli": 1000,
                    "occurred_at": "2026-06-01T00:00:00Z",
                }
            ]
        },
        headers=auth(op_key),
    )
    assert ingested.status_code == 200, ingested.text
    for k in (a_key, b_key):  # both have budgets: B reads its own, never A's
        budget = client.put("/v1/budget", json={"spend_limit": 10**9}, headers=auth(k))
        assert budget.status_code == 200, budget.text
    commitment = client.post(
        f"/v1/admin/tenants/{a.id}/commitments",
        json={
            "gpu_model": "H100-80GB",
            "gpus": 1,
            "starts_at": "2026-06-01T00:00:00Z",
            "ends_at": "2026-07-01T00:00:00Z",
        },
        headers=auth(op_key),
    )
    assert commitment.status_code == 201, commitment.text
    # An application error: the experiment takes nothing out of the pool.
    experiment = client.post(
        "/v1/admin/chaos/experiments",
        json={
            "name": "matrix",
            "faults": [{"kind": "xid", "code": 13, "target": {"node": node.name, "gpu": 0}}],
            "blast_radius": {"max_gpus": 1, "max_region_share": 1},
        },
        headers=auth(op_key),
    )
    assert experiment.status_code == 201, experiment.text
    stack = client.post(
        "/v1/admin/stacks",
        json={"name": "matrix-stack", "components": {"driver": "560.35.03", "cuda": "12.6"}},
        headers=auth(op_key),
    )
    assert stack.status_code == 201, stack.text
    # An upgrade as recorded (starting one needs nodes with agents: tests/fleet/test_upgrades.py).
    from app.models.fleet import Upgrade

    upgrade = Upgrade(
        stack_id=uuid.UUID(stack.json()["id"]),
        scope_kind="pool",
        scope="matrix",
        batch="1",
        units_at_once=1,
        max_unavailable_pct=10.0,
        max_failures=1,
        drain_wait_s=0,
        state="done",
        failures=0,
        failures_before=0,
        commands={},
    )
    session.add(upgrade)
    session.commit()
    from cryptography.hazmat.primitives import serialization as openssh
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public_key = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(openssh.Encoding.OpenSSH, openssh.PublicFormat.OpenSSH)
        .decode()
    )
    ssh_key = client.post(
        "/v1/ssh-keys", json={"name": "matrix", "public_key": public_key}, headers=auth(a_key)
    )
    assert ssh_key.status_code == 201, ssh_key.text
    secret = client.put("/v1/secrets/matrix", json={"value": "a's secret"}, headers=auth(a_key))
    assert secret.status_code == 201, secret.text
    volume = client.put("/v1/volumes/matrix", json={"storage": "node"}, headers=auth(a_key))
    assert volume.status_code == 201, volume.text
    endpoint = client.post(
        "/v1/endpoints",
        json={"name": "matrix", "replica": {"gpus": 1}, "min_replicas": 0},
        headers=auth(a_key),
    )
    assert endpoint.status_code == 201, endpoint.text
    ids = {
        "tenant_id": str(a.id),
        "commitment_id": commitment.json()["id"],
        "key_id": str(session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == a.id).limit(1))),
        "import_id": r.json()["id"],
        "rack_id": str(session.scalar(select(Rack.id).limit(1))),
        "node_id": str(node.id),
        "gpu_id": str(session.scalar(select(Gpu.id).limit(1))),
        "region_id": str(session.scalar(select(Region.id).limit(1))),
        "workload_id": w.json()["id"],
        "experiment_id": experiment.json()["id"],
        "name": stack.json()["name"],
        "upgrade_id": str(upgrade.id),
        "ssh_key_id": ssh_key.json()["id"],
        "secret_name": "matrix",
        "volume_name": "matrix",
        "endpoint_name": "matrix",
        "attempt": "1",
        "replica": "0",
    }
    return {
        "a": a,
        "a_key": a_key,
        "b_key": b_key,
        "op": op_key,
        "revoked": revoked,
        "revoked_op": revoked_op,
        "ids": ids,
    }


def _key_id(session, full_key: str) -> str:
    from sqlalchemy import select

    from app.models.keys import ApiKey

    session.expire_all()
    return str(session.scalar(select(ApiKey.id).where(ApiKey.prefix == full_key[3:11])))


def _operations(client):
    spec = client.get("/openapi.json").json()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            yield method.upper(), path, op


def _fill(path: str, ids: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        assert name in ids, f"no fixture for path parameter {name!r} in {path}: add one to matrix()"
        return ids[name]

    return re.sub(r"\{([^}]+)\}", sub, path)


def _call(client, method: str, url: str, headers: dict, body: dict | None = None):
    return client.request(
        method,
        url,
        headers={**headers, "content-type": "application/json"},
        content=json.dumps(body if body is not None else {}),
    )


def test_every_route_is_covered_by_the_matrix(client, matrix):
    ops = list(_operations(client))
    assert len(ops) >= 20
    for method, path, op in ops:
        if (method, path) in PUBLIC:
            assert not op.get("security"), f"{method} {path} is public but documents security"
        else:
            assert op.get("security"), (
                f"{method} {path} is not authenticated: add it to PUBLIC or fix it"
            )


def test_without_or_with_bad_keys_every_private_route_is_401(client, matrix):
    bad = {
        "none": {},
        "malformed": auth("rp_not-a-key"),
        "unknown": auth("rp_" + "A" * 48),
        "wrong scheme": {"Authorization": f"Basic {matrix['a_key']}"},
        "revoked tenant key": auth(matrix["revoked"]),
        "revoked operator key": auth(matrix["revoked_op"]),
        "right prefix, wrong secret": auth(matrix["a_key"][:11] + "x" * 40),
    }
    for method, path, _ in _operations(client):
        if (method, path) in PUBLIC:
            continue
        url = _fill(path, matrix["ids"])
        for label, headers in bad.items():
            r = _call(client, method, url, headers)
            assert r.status_code == 401, f"{label}: {method} {path} -> {r.status_code} {r.text}"
            assert r.headers["content-type"].startswith("application/problem+json")
            # A portal session's own routes want its cookie, whatever key is sent.
            session_only = {"no_session"} if path.startswith("/v1/sessions/") else set()
            # A node agent's routes take its node credential, never an API key.
            node_only = {"invalid_node_credential"} if path.startswith("/v1/agent/") else set()
            assert r.json()["code"] in {
                "missing_api_key",
                "invalid_api_key",
                "revoked_api_key",
                *session_only,
                *node_only,
            }


def test_tenant_keys_on_operator_routes_are_403(client, matrix):
    for method, path, _ in _operations(client):
        if not path.startswith("/v1/admin/"):
            continue
        r = _call(client, method, _fill(path, matrix["ids"]), auth(matrix["a_key"]))
        assert r.status_code == 403, f"{method} {path} -> {r.status_code}"
        assert r.json()["code"] == "platform_scope_required"


def test_other_tenants_objects_are_404_and_never_leak(client, matrix):
    a_ids = {matrix["ids"][k] for k in ("tenant_id", "key_id", "workload_id")}
    checked = 0
    for method, path, op in _operations(client):
        # A portal session's routes answer only for the cookie's own session (test_sessions).
        # A node agent's routes answer to node credentials only (test_agents_join).
        if (method, path) in PUBLIC or path.startswith(
            ("/v1/admin/", "/v1/sessions/", "/v1/agent/")
        ):
            continue
        body = BODIES.get((method, path))
        if (method, path) in BY_NAME:
            # Names are each tenant's own: B's PUT sets B's secret (or makes B's volume) of that
            # name, never A's.
            r = _call(client, method, _fill(path, matrix["ids"]), auth(matrix["b_key"]), body)
            assert r.status_code == 201, f"{method} {path} with another tenant's key -> {r.text}"
            a_view = client.get(_fill(path, matrix["ids"]), headers=auth(matrix["a_key"])).json()
            assert a_view.get("version", 1) == 1 and a_view["id"] != r.json()["id"]
            gone = client.delete(_fill(path, matrix["ids"]), headers=auth(matrix["b_key"]))
            assert gone.status_code == 204  # B's own again, so the other routes see none
            continue
        if "{" in path:
            if op.get("requestBody"):
                assert body is not None, f"add a valid body for {method} {path} to BODIES"
            r = _call(client, method, _fill(path, matrix["ids"]), auth(matrix["b_key"]), body)
            assert r.status_code == 404, (
                f"{method} {path} with another tenant's key -> {r.status_code}"
            )
            assert r.headers["content-type"].startswith("application/problem+json")
            checked += 1
            # The problem may echo the id the caller sent (detail, instance), nothing else of A's.
            text = json.dumps(
                {k: v for k, v in r.json().items() if k not in ("detail", "instance")}
            )
        elif method == "GET":
            params = QUERIES.get((method, path))
            r = client.get(path, params=params, headers=auth(matrix["b_key"]))
            assert r.status_code == 200, f"{method} {path} -> {r.status_code}"
            if params:  # and A sees its own there, so the check above has teeth
                mine = client.get(path, params=params, headers=auth(matrix["a_key"]))
                assert any(i in mine.text for i in a_ids), f"{method} {path}: A sees nothing"
            text = r.text
        else:
            continue
        assert not any(i in text for i in a_ids), f"{method} {path} leaked tenant A's data"
    assert checked >= 2
    # The DELETE above did not touch tenant A's key.
    r = client.get(f"/v1/keys/{matrix['ids']['key_id']}", headers=auth(matrix["a_key"]))
    assert r.status_code == 200 and r.json()["revoked_at"] is None


def test_operator_key_reaches_operator_routes(client, matrix):
    for method, path, _ in _operations(client):
        if method == "GET" and path.startswith("/v1/admin/"):
            params = QUERIES.get((method, path))
            r = client.get(_fill(path, matrix["ids"]), params=params, headers=auth(matrix["op"]))
            assert r.status_code == 200, f"{path} -> {r.status_code} {r.text}"


def test_one_route_where_a_tenant_and_an_operator_ask_the_same_question(client, matrix):
    """The merged routes (issue 48 §3, app.core.routing.ALIASES): an operator gets the same
    answer at the old operators' URL as at the merged one; a tenant gets its own at the merged
    one and, at the operators' URL, the 403 it always got; a tenant naming another tenant sees
    nothing of that tenant's."""
    from app.core.routing import ALIASES

    assert sorted((m, old, new) for m, old, new in ALIASES) == [
        ("GET", "/v1/admin/billing/exports", "/v1/billing/exports"),
        ("GET", "/v1/admin/prices", "/v1/prices"),
        ("GET", "/v1/admin/usage", "/v1/usage"),
    ]
    op, a_key, b_key = (auth(matrix[k]) for k in ("op", "a_key", "b_key"))
    a_id = matrix["ids"]["tenant_id"]
    # A window in the past, so that running work accrued up to now does not differ by a
    # millisecond between the two calls.
    past = {"from": "2026-06-01T00:00:00Z", "to": "2026-07-01T00:00:00Z", "group_by": "tenant_id"}
    for method, old, new in ALIASES:
        params = past if new == "/v1/usage" else QUERIES.get((method, new))
        at_old = client.request(method, old, params=params, headers=op)
        at_new = client.request(method, new, params=params, headers=op)
        assert at_old.status_code == at_new.status_code == 200, (old, at_old.text, at_new.text)
        assert at_old.content == at_new.content, old
        assert at_old.headers["content-type"] == at_new.headers["content-type"]
        if new != "/v1/prices":  # the price book holds no tenant's data; the rest hold A's
            assert a_id in at_new.text, f"{new}: the operator does not see tenant A"
        mine = client.request(method, new, params=params, headers=a_key)
        assert mine.status_code == 200, mine.text
        refused = client.request(method, old, params=params, headers=a_key)
        assert refused.status_code == 403, (old, refused.text)
        assert refused.json()["code"] == "platform_scope_required"
    # Naming a tenant narrows what the caller may see; it never widens it.
    one = {**past, "tenant_id": a_id}
    as_op = client.get("/v1/usage", params=one, headers=op).json()
    assert as_op["rows"] and a_id in json.dumps(as_op)
    as_b = client.get("/v1/usage", params=one, headers=b_key)
    assert as_b.status_code == 200 and a_id not in as_b.text and not as_b.json()["rows"]


def test_node_and_workload_credentials_reach_only_their_own(client, matrix, session):
    """A node credential speaks for its node only, a workload token for its workload's current
    run only, and neither is an API key; a join token works once and never after it expires."""
    from sqlalchemy import select, update

    from app.models.agents import NodeJoinToken
    from app.models.fleet import Node
    from app.tenancy.run_tokens import mint

    op = auth(matrix["op"])
    nodes = {n.name: str(n.id) for n in session.scalars(select(Node)).all()}
    a_name, b_name = sorted(nodes)[:2]

    def token(node_id: str) -> str:
        r = client.post(f"/v1/admin/nodes/{node_id}/join-tokens", headers=op)
        assert r.status_code == 201, r.text
        return r.json()["token"]

    t = token(nodes[a_name])
    cred = client.post("/v1/agent/join", json={"token": t}).json()["credential"]
    # Reused, or expired: refused.
    again = client.post("/v1/agent/join", json={"token": t})
    assert again.status_code == 401 and again.json()["code"] == "invalid_join_token"
    late = token(nodes[b_name])
    session.execute(update(NodeJoinToken).values(expires_at=NodeJoinToken.created_at))
    session.commit()
    expired = client.post("/v1/agent/join", json={"token": late})
    assert expired.status_code == 401 and expired.json()["code"] == "invalid_join_token"

    # The node's own state only: there is no way to name another node.
    mine = client.get("/v1/agent/assignments", params={"wait": "0s"}, headers=auth(cred))
    assert mine.status_code == 200 and mine.json()["node"] == a_name
    # A tenant's secrets reach only the node that starts that run, at that attempt: never
    # another attempt's (the workload may be placed on this node by now, at its current one).
    from app.models.workloads import Workload

    w_id = matrix["ids"]["workload_id"]
    current = session.scalar(select(Workload.attempts).where(Workload.id == uuid.UUID(w_id)))
    for attempt in (current + 1, current + 7):
        r = client.get(f"/v1/agent/runs/{w_id}/{attempt}/0/env", headers=auth(cred))
        assert r.status_code == 409 and r.json()["code"] == "run_not_startable", r.text
        r = client.get(f"/v1/agent/runs/{w_id}/{attempt}/0/env", headers=auth(matrix["a_key"]))
        assert r.status_code == 401, r.text
    # A node credential is no API key, and an API key no node credential.
    for method, path in (("GET", "/v1/workloads"), ("GET", "/v1/admin/nodes")):
        r = client.request(method, path, headers=auth(cred))
        assert r.status_code == 401, (path, r.text)

    # A workload token: its own workload's reports, its current run, nothing else.
    w = matrix["ids"]["workload_id"]
    other = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(matrix["a_key"])
    ).json()["id"]
    attempt = session.scalar(select(Workload.attempts).where(Workload.id == uuid.UUID(w)))
    own = mint(uuid.UUID(w), attempt)
    ok = client.post(
        f"/v1/workloads/{w}/progress",
        json=BODIES[("POST", "/v1/workloads/{workload_id}/progress")],
        headers=auth(own),
    )
    assert ok.status_code != 401, ok.text  # past authentication (the workload is not running)
    stale = mint(uuid.UUID(w), attempt + 7)  # another run of the same workload
    for url, headers in (
        (f"/v1/workloads/{other}/checkpoints", auth(own)),
        (f"/v1/workloads/{w}/checkpoints", auth(stale)),
    ):
        r = client.post(url, json={"size_bytes": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["code"] == "invalid_workload_token", r.text
    for method, path in (
        ("GET", "/v1/workloads"),
        ("GET", f"/v1/workloads/{w}"),
        ("DELETE", f"/v1/workloads/{w}"),
        ("GET", "/v1/agent/assignments"),
    ):
        r = client.request(method, path, headers=auth(own))
        assert r.status_code == 401, (method, path, r.text)


def test_a_node_credential_is_walled_to_its_own_runs_and_its_own_bucket(
    client, matrix, session, monkeypatch
):
    """What a stolen node credential can still reach (issue 44, section 0;
    tests/agents/test_node_wall.py has each at length): logs of the runs its node holds only,
    never another attempt's; one rotate per credential; no GPU UUID another node holds; a bucket
    and body caps of its own."""
    from datetime import UTC, datetime

    from sqlalchemy import func, select, update

    from app.core.config import get_settings
    from app.models.agents import NodeCredential
    from app.models.fleet import Gpu, Node
    from app.models.workloads import Allocation, Workload

    op = auth(matrix["op"])
    nodes = {n.name: n for n in session.scalars(select(Node)).all()}
    a, b = nodes["h100-1"], nodes["h100-2"]

    def join(node) -> str:
        t = client.post(f"/v1/admin/nodes/{node.id}/join-tokens", headers=op).json()["token"]
        return client.post("/v1/agent/join", json={"token": t}).json()["credential"]

    cred_a, cred_b = join(a), join(b)

    # Logs: tenant A's workload ran its first attempt on a (ended), its second runs on b.
    w = uuid.UUID(matrix["ids"]["workload_id"])
    now = datetime.now(UTC)
    for node, attempt, released in ((a, 1, now), (b, 2, None)):
        session.add(
            Allocation(
                workload_id=w,
                tenant_id=matrix["a"].id,
                node_id=node.id,
                replica=0,
                attempt=attempt,
                tier="dedicated-gpu",
                gpu_indices=[0],
                milli=1000,
                released_at=released,
            )
        )
    session.execute(update(Workload).where(Workload.id == w).values(attempts=2))
    session.commit()

    def chunk(attempt: int, offset: int) -> dict:
        return {
            "workload_id": str(w),
            "attempt": attempt,
            "replica": 0,
            "offset": offset,
            "data": "x\n",
            "at": now.isoformat(),
        }

    for cred, attempt, taken in (
        (cred_a, 1, True),  # its own attempt's tail, after the run ended
        (cred_a, 2, False),  # the attempt now running elsewhere
        (cred_b, 2, True),
        (cred_b, 1, False),  # an attempt it never held
    ):
        r = client.post(
            "/v1/agent/logs", json={"chunks": [chunk(attempt, 10 * attempt)]}, headers=auth(cred)
        )
        assert r.status_code == 200, r.text
        assert r.json() == {"accepted": int(taken), "stale": int(not taken)}, (attempt, r.text)

    # A rotate retires the credential presented: once.
    rotated = client.post("/v1/agent/credentials:rotate", headers=auth(cred_a))
    assert rotated.status_code == 201, rotated.text
    again = client.post("/v1/agent/credentials:rotate", headers=auth(cred_a))
    assert again.status_code == 401 and again.json()["code"] == "invalid_node_credential"
    session.expire_all()
    live = select(func.count()).where(
        NodeCredential.node_id == a.id, NodeCredential.revoked_at.is_(None)
    )
    assert session.scalar(live) == 1

    # A GPU UUID the fleet records on another node is a named difference, and stays where it is.
    session.execute(
        update(Gpu).where(Gpu.node_id == a.id, Gpu.index == 0).values(uuid="GPU-matrix-0")
    )
    session.commit()
    inventory = {
        "hostname": b.name,
        "source": "file",
        "gpus": [
            {"index": i, "uuid": "GPU-matrix-0" if i == 0 else f"GPU-b-{i}", "model": "H100-80GB"}
            for i in range(8)
        ],
        "address": "h100-2.test",
        "runtimes": ["process"],
        "agent_version": "test",
    }
    r = client.put("/v1/agent/inventory", json=inventory, headers=auth(cred_b))
    assert r.status_code == 200, r.text
    assert r.json()["differences"] == [
        "GPU 0 reports GPU-matrix-0, which the fleet records on node h100-1 GPU 0"
    ]
    session.expire_all()
    assert session.scalar(select(Gpu.node_id).where(Gpu.uuid == "GPU-matrix-0")) == a.id

    # Body caps of the agent's own, below the operator's.
    s = get_settings()
    for path, cap in (
        ("/v1/agent/telemetry", s.max_agent_telemetry_bytes),
        ("/v1/agent/logs", s.max_agent_log_bytes),
    ):
        assert cap < s.max_telemetry_bytes
        r = client.post(path, content=b"#" * (cap + 1), headers=auth(cred_b))
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large", (path, r.text)

    # A bucket per node: one node's agent spends its own, not another's.
    monkeypatch.setattr(s, "agent_rate_limit", 0.05)
    monkeypatch.setattr(s, "agent_rate_burst", 2.0)
    monkeypatch.setattr(s, "broker_key_prefix", f"{s.broker_key_prefix}wall{uuid.uuid4().hex}:")
    codes = [client.get("/v1/agent/node", headers=auth(cred_b)).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert (
        client.get("/v1/agent/node", headers=auth(rotated.json()["credential"])).status_code == 200
    )
