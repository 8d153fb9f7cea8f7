"""Burn-in on the control plane: a node's first matching inventory puts it in `validating` with
a suite for its agent; every step passed puts it in service (its time to production recorded),
a failure names the step and the GPU and sends it to repair, a second failure out for RMA; a
burn-in the agent never finishes fails at its limit. The agent here is the test, speaking the
wire (tests/agent/test_burnin.py runs the agent's side with real processes)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import select

from tests.fixtures.agent_api import fake_inventory, join_node
from tests.fixtures.world import auth, wait_until

FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-b
        kind: hgx
        gpu_model: H100-80GB
        nodes:
          - {name: b-1, gpus: 4}
          - {name: b-2, gpus: 4}
          - {name: b-3, gpus: 4}
"""


def _node(client, op, name):
    nodes = client.get("/v1/admin/nodes", params={"limit": 50}, headers=auth(op)).json()["items"]
    return next(n for n in nodes if n["name"] == name)


def _burn(client, cred):
    return client.get("/v1/agent/assignments", params={"wait": "0s"}, headers=auth(cred)).json()[
        "burn_in"
    ]


def _report(client, cred, burn, results, done=True):
    r = client.post(
        "/v1/agent/status",
        json={"burn_in": {"id": burn["id"], "results": results, "done": done}},
        headers=auth(cred),
    )
    assert r.status_code == 200, r.text


def test_bring_up_repair_and_rma(client, world, session, celery_worker_process):
    from app.health import burnin
    from app.models.fleet import Node
    from app.models.health import BurnIn

    world.fleet(FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    creds = {n: join_node(client, op, n) for n in ("b-1", "b-2", "b-3")}

    # The first matching inventory: validating, with the default suite for an H100 node.
    for n in creds:
        client.put("/v1/agent/inventory", json=fake_inventory(n), headers=auth(creds[n]))
    assert _node(client, op, "b-1")["health"] == "validating"
    burn = _burn(client, creds["b-1"])
    assert [s["name"] for s in burn["steps"]] == ["dcgm-diag", "nccl-all-reduce"]
    assert burn["steps"][0]["command"] == ["dcgmi", "diag", "-r", "3"]
    assert burn["steps"][1]["min_busbw_gbps"] == 376.0  # 80 % of H100's published 470
    dry = client.post(
        "/v1/workloads:dry-run", json={"kind": "instance", "gpus": 1}, headers=auth(key)
    )
    assert dry.json()["placeable_now"] is False, "nothing is placed on nodes burning in"
    # It waits for them (issue 45 item 7: it said "does not fit the fleet"), naming them.
    assert dry.json()["reason"].startswith("waits: it fits the fleet"), dry.json()
    assert "b-1 (validating)" in dry.json()["reason"]
    never = client.post(
        "/v1/workloads:dry-run", json={"kind": "instance", "gpus": 16}, headers=auth(key)
    )
    assert never.json()["reason"].startswith("does not fit the fleet: "), never.json()

    # b-1 passes (DCGM not installed: its optional step skipped): in service, in production.
    _report(
        client,
        creds["b-1"],
        burn,
        [
            {"name": "dcgm-diag", "status": "skipped", "seconds": 0, "detail": "not installed"},
            {"name": "nccl-all-reduce", "status": "passed", "busbw_gbps": 455.1, "seconds": 41},
        ],
    )
    b1 = _node(client, op, "b-1")
    assert b1["health"] == "healthy" and b1["production_at"] is not None
    assert _burn(client, creds["b-1"]) is None, "the agent may forget it"
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 4}, headers=auth(key))
    wid = w.json()["id"]
    wait_until(
        lambda: client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["placement"],
        timeout=30,
    )

    # b-2 under-performs on GPU 2: the failure named, repaired (a reboot), burned in again.
    burn2 = _burn(client, creds["b-2"])
    slow = {
        "name": "nccl-all-reduce",
        "status": "failed",
        "gpu": 2,
        "busbw_gbps": 120.5,
        "detail": "bus bandwidth 120.5 GB/s is below the bound 376",
        "seconds": 40,
    }
    ok = {"name": "dcgm-diag", "status": "passed", "seconds": 300}
    _report(client, creds["b-2"], burn2, [ok], done=False)
    assert _node(client, op, "b-2")["health"] == "validating", "one step in: still burning in"
    _report(client, creds["b-2"], burn2, [ok, slow])
    b2 = _node(client, op, "b-2")
    assert b2["health"] in ("quarantined", "repairing"), b2
    events = client.get(f"/v1/admin/nodes/{b2['id']}/health-events", headers=auth(op)).json()
    quarantined = [e for e in events["items"] if e["to_state"] == "quarantined"]
    causes = {(e["gpu_index"], e["cause"]) for e in quarantined}
    named = "burn-in failed at nccl-all-reduce: failed on GPU 2: bus bandwidth 120.5 GB/s is "
    assert {g for g, c in causes if c.startswith(named)} == {None, 2}, causes

    # The reboot (2 s here) ends in validating and a new burn-in for the repair.
    def repaired_burn():
        b = _burn(client, creds["b-2"])
        return b if b and b["id"] != burn2["id"] else None

    burn3 = wait_until(repaired_burn, timeout=30)
    assert _node(client, op, "b-2")["health"] == "validating"
    _report(client, creds["b-2"], burn3, [ok, slow])
    b2 = _node(client, op, "b-2")
    assert b2["health"] == "out_of_service" and "failed twice: out for RMA" in b2["health_reason"]
    assert b2["production_at"] is None

    # b-3's agent never finishes: at its limit the burn-in fails, and the node is repaired.
    session.expire_all()
    b3 = session.scalar(select(Node).where(Node.name == "b-3"))
    row = session.scalar(select(BurnIn).where(BurnIn.node_id == b3.id))
    later = row.started_at + timedelta(hours=2)
    # The operator's bring-up view: b-3 burning in, then (at `later`) stuck past its limit.
    view = client.get("/v1/admin/bring-up", headers=auth(op)).json()
    b3_now = next(i for i in view["items"] if i["node"] == "b-3")
    assert (b3_now["why"], b3_now["step"], b3_now["steps"], b3_now["stuck"]) == (
        "bring-up",
        "dcgm-diag",
        2,
        None,
    )
    assert not any(i["node"] == "b-1" for i in view["items"]), "in production: not listed"
    # Unless it is out of service: its agent silent, it is being power-cycled (issue 45 item 8:
    # Lifecycle said every node with an agent was in service while Health said `repairing`).
    b1 = session.scalar(select(Node).where(Node.name == "b-1"))
    b1.health = "repairing"
    session.flush()
    out = {i.node: i for i in burnin.bring_up(session, later).items}
    assert out["b-1"].health == "repairing" and out["b-1"].stuck.startswith(
        "its agent is silent since"
    ), out["b-1"]
    session.rollback()
    stuck = {i.node: i.stuck for i in burnin.bring_up(session, later).items}
    assert stuck["b-3"] == "burn-in past its limit at dcgm-diag"
    assert burnin.overdue(session, later) == 1
    session.commit()
    session.expire_all()
    row = session.get(BurnIn, row.id)
    assert (row.status, row.failed_step) == ("failed", "dcgm-diag")
    b3_events = client.get(f"/v1/admin/nodes/{b3.id}/health-events", headers=auth(op)).json()
    assert any(
        e["to_state"] == "quarantined"
        and e["cause"] == "burn-in failed at dcgm-diag: no result from the node's agent in time"
        for e in b3_events["items"]
    ), b3_events
    assert _node(client, op, "b-3")["health"] == "repairing"

    # Bring-up on /metrics: who is burning in, time to production, GPU-hours spent.
    metrics = client.get("/metrics").text
    assert 'rackplane_time_to_production_seconds_count{fleet="all"} 1.0' in metrics
    assert 'rackplane_burn_in_nodes{reason="bring-up"} 0.0' in metrics
    assert 'rackplane_burn_in_gpu_hours_total{outcome="rma"}' in metrics


def test_a_fleets_burn_ins_are_judged_together_each_on_its_own_merits(client, world, session):
    """`take_many` (the API judges a bring-up's finished burn-ins in batches): in one call, one
    passes, one fails, a stale one (another node's id) is no news, and each node moves as its
    own report says."""
    from app.core.db import utcnow
    from app.health import burnin
    from app.models.fleet import Node
    from rackplane_wire import BurnInReport

    world.fleet(FLEET)
    op = world.key()
    creds = {n: join_node(client, op, n) for n in ("b-1", "b-2", "b-3")}
    burns = {}
    for n, cred in creds.items():
        client.put("/v1/agent/inventory", json=fake_inventory(n), headers=auth(cred))
        burns[n] = _burn(client, cred)
    ids = {n: uuid.UUID(_node(client, op, n)["id"]) for n in creds}

    def report(n: str, status: str) -> BurnInReport:
        steps = [{"name": s["name"], "status": status, "seconds": 0.1} for s in burns[n]["steps"]]
        return BurnInReport(id=burns[n]["id"], results=steps, done=True)

    news = burnin.take_many(
        session,
        [
            (ids["b-1"], report("b-1", "passed")),
            (ids["b-2"], report("b-2", "failed")),
            (ids["b-3"], report("b-1", "passed")),  # b-1's burn-in, sent by b-3: stale
        ],
        utcnow(),
    )
    session.commit()
    assert news == [True, True, False]
    health = dict(session.execute(select(Node.name, Node.health)).all())
    assert health["b-1"] == "healthy" and health["b-2"] != "healthy"
    assert health["b-3"] == "validating"
