"""Node states act (real PostgreSQL, Redis and a Celery worker), as the one table
`NODE_STATE_EFFECT` says: `down` stops the work on the node at that moment (its usage too) and
requeues it from its last checkpoint, so it runs again elsewhere; `draining` gives running work
its checkpoint grace, then moves it; `cordoned` only stops new placements."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import text

from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth, wait_until

FLEET = fleet(2)  # two HGX H100 nodes, h1 and h2


def _get(client, key, wid):
    return client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()


def _running_on(client, key, wid, timeout=30):
    w = wait_until(lambda: (x := _get(client, key, wid))["state"] == "running" and x, timeout)
    return {p["node"] for p in w["placement"]}


def _node_id(client, op, name):
    nodes = client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]
    return next(n["id"] for n in nodes if n["name"] == name)


def _states(client, key, wid):
    ev = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
    return [e["to_state"] for e in ev if e["kind"] == "transition"], ev


def test_a_node_down_stops_its_work_now_and_it_runs_again_elsewhere(
    client, world, session, celery_worker_process
):
    world.fleet(FLEET)
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    vm = client.post("/v1/workloads", json={"kind": "vm", "gpus": 4}, headers=auth(key)).json()
    [node] = _running_on(client, key, vm["id"])
    r = client.patch(
        f"/v1/admin/nodes/{_node_id(client, op, node)}",
        json={"state": "down", "reason": "PSU failed"},
        headers=auth(op),
    )
    assert r.status_code == 200
    states, events = _states(client, key, vm["id"])
    assert states[-3:] == ["running", "preempted", "queued"]
    assert events[-2]["reason"] == f"stopped: node {node} is down"
    assert events[-1]["details"]["resumes_from"] == "start"
    down_at = datetime.fromisoformat(events[-2]["at"])
    # Metering stopped at that moment, not later.
    session.rollback()
    [stop] = session.execute(
        text("SELECT occurred_at FROM usage_events WHERE workload_id = :w AND kind = 'stop'"),
        {"w": vm["id"]},
    ).scalars()
    assert stop == down_at
    again = _running_on(client, key, vm["id"])
    assert again and node not in again  # on the other node


def test_draining_gives_the_grace_then_moves_and_cordoned_only_stops_new_work(
    client, world, celery_worker_process
):
    world.fleet(FLEET)
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    a = client.post("/v1/workloads", json={"kind": "instance", "gpus": 2}, headers=auth(key))
    wid = a.json()["id"]
    [node] = _running_on(client, key, wid)
    other = "h2" if node == "h1" else "h1"
    # Cordon the other node: nothing there moves, nothing new lands there.
    client.patch(
        f"/v1/admin/nodes/{_node_id(client, op, other)}",
        json={"state": "cordoned"},
        headers=auth(op),
    )
    assert _get(client, key, wid)["state"] == "running"
    client.patch(
        f"/v1/admin/nodes/{_node_id(client, op, node)}",
        json={"state": "draining"},
        headers=auth(op),
    )
    states, events = _states(client, key, wid)
    assert states[-1] == "checkpointing" and f"node {node} is draining" in events[-1]["reason"]
    # After the grace (1 s in tests) it is requeued; with both nodes out it waits ...
    wait_until(lambda: _get(client, key, wid)["state"] == "queued", timeout=30)
    # ... and runs once the cordoned node is back.
    client.patch(
        f"/v1/admin/nodes/{_node_id(client, op, other)}",
        json={"state": "ready"},
        headers=auth(op),
    )
    assert _running_on(client, key, wid) == {other}


def test_a_retired_node_leaves_the_fleet_and_what_needed_it_fails(
    client, world, celery_worker_process
):
    world.fleet(FLEET)
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    one = client.post("/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key))
    [node] = _running_on(client, key, one.json()["id"])
    both = client.post(  # needs both nodes: waits while one is busy
        "/v1/workloads", json={"kind": "job", "gpus": 8, "replicas": 2}, headers=auth(key)
    ).json()
    small = client.post(  # fits the remaining node later: keeps waiting
        "/v1/workloads", json={"kind": "instance", "gpus": 4}, headers=auth(key)
    ).json()
    other = "h2" if node == "h1" else "h1"
    r = client.patch(
        f"/v1/admin/nodes/{_node_id(client, op, other)}",
        json={"state": "retired", "reason": "decommissioned"},
        headers=auth(op),
    )
    assert r.status_code == 200, r.text
    gone = _get(client, key, both["id"])
    assert gone["state"] == "failed"
    _, events = _states(client, key, both["id"])
    assert events[-1]["details"]["cause"] == "does_not_fit_fleet"
    assert "can no longer hold it" in events[-1]["reason"]
    assert _get(client, key, small["id"])["state"] in ("queued", "placing", "provisioning")
    # The fleet is smaller, for good: capacity and new submissions say so.
    [row] = client.get("/v1/capacity", headers=auth(key)).json()["items"]
    assert row["total_gpus"] == 8
    again = client.post(
        "/v1/workloads", json={"kind": "job", "gpus": 8, "replicas": 2}, headers=auth(key)
    )
    assert again.status_code == 422 and again.json()["code"] == "does_not_fit_fleet"
    back = client.patch(
        f"/v1/admin/nodes/{_node_id(client, op, other)}",
        json={"state": "ready"},
        headers=auth(op),
    )
    assert back.status_code == 409  # retired is for good
