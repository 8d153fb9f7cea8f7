"""The health loop end to end (real PostgreSQL, Redis and a Celery worker): an Xid pushed as
telemetry takes the GPU out, stops the gang on every replica with its usage ending at the fault,
requeues it ahead of its peers to resume from its checkpoint, records the lost work, and the
provider's repair brings the hardware back. Application errors only notify; warnings watch."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from tests.fixtures.health import exporter_text, health, history, push
from tests.fixtures.workloads import ALL, fleet, running, state
from tests.fixtures.world import auth, wait_until

FLEET = fleet(3)  # h1..h3: HGX H100 x8


def _events(client, key, wid):
    return client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]


def _xid(client, op, node, gpu, code, at: float | None = None):
    body = exporter_text(
        node, {"DCGM_FI_DEV_XID_ERRORS": {gpu: code}}, int((at or time.time()) * 1000)
    )
    r = push(client, op, body)
    assert r.status_code == 200 and r.json()["signals"] == 1, r.text
    return r


@pytest.fixture
def setup(client, world, celery_worker_process):
    world.fleet(FLEET)
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    return client, key, op


def test_xid_79_on_one_gpu_moves_the_whole_gang_from_its_checkpoint(setup, session):
    client, key, op = setup
    gang = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 8, "replicas": 2, "checkpoint": {"interval_s": 600}},
        headers=auth(key),
    ).json()
    w = running(client, key, gang["id"])
    nodes = sorted({p["node"] for p in w["placement"]})
    assert len(nodes) == 2
    ckpt = datetime.now(UTC)
    r = client.post(
        f"/v1/workloads/{gang['id']}/checkpoints",
        json={"completed_at": ckpt.isoformat(), "size_bytes": 1 << 30},
        headers=auth(key),
    )
    assert r.status_code in (200, 201, 204), r.text
    time.sleep(1.0)
    fault = time.time() - 0.2
    _xid(client, op, nodes[0], 3, 79, at=fault)
    # Stopped on both replicas, requeued ahead of its peers, and running again.
    wait_until(lambda: state(client, key, gang["id"])["interruptions"] == 1, timeout=15)
    again = running(client, key, gang["id"], timeout=30)
    events = _events(client, key, gang["id"])
    transitions = [e for e in events if e["kind"] == "transition"]
    states = [e["to_state"] for e in transitions]
    i = states.index("preempted")
    stop, requeue = transitions[i], transitions[i + 1]
    assert "Xid 79 (GPU has fallen off the bus)" in stop["reason"]
    assert stop["details"]["xid"] == 79 and stop["details"]["action"] == "reboot_node"
    assert requeue["to_state"] == "queued" and requeue["details"]["expedited"] is True
    assert requeue["details"]["resumes_from"] == "checkpoint"
    assert "ahead of its priority peers" in requeue["reason"]
    fault_at = datetime.fromisoformat(stop["details"]["fault_at"])
    assert abs(fault_at.timestamp() - fault) < 0.01  # dated by the sample, not by when it ran
    # Lost work: 16 GPUs x the time from the checkpoint to the fault.
    expect = 16 * (fault_at - ckpt).total_seconds()
    assert again["lost_work_gpu_s"] == pytest.approx(expect, abs=0.05)
    assert again["expedited"] is False  # it runs again
    # No usage after the fault: both replicas' allocations stopped at the fault's instant.
    session.rollback()
    stops = session.execute(
        text(
            "SELECT occurred_at, reason FROM usage_events WHERE workload_id = :w AND kind = 'stop'"
        ),
        {"w": gang["id"]},
    ).all()
    assert (
        len(stops) == 2
        and {s[0] for s in stops} == {fault_at}
        and {s[1] for s in stops} == {"gpu_fault"}
    )

    # The node was rebooted by the provider and is validated by its agent reporting again (a
    # node out of the pool has every report's heartbeat written).
    def back():
        client.post("/v1/admin/telemetry", json={"nodes": [nodes[0]]}, headers=auth(op))
        return health(session, nodes[0]) == "healthy"

    wait_until(back, timeout=20, interval=0.3)
    assert history(session, nodes[0]) == [
        "quarantined",
        "draining",
        "repairing",
        "validating",
        "healthy",
    ]
    assert history(session, nodes[0], 3)[:3] == ["quarantined", "draining", "repairing"]
    inc = session.execute(text("SELECT code, action, scope, repair FROM health_incidents")).one()
    assert tuple(inc) == (79, "reboot_node", "node", "reboot")


def test_an_application_error_only_tells_the_owner(setup, session):
    client, key, op = setup
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key)).json()
    [node] = {p["node"] for p in running(client, key, w["id"])["placement"]}
    _xid(client, op, node, 2, 13)
    notice = wait_until(
        lambda: [e for e in _events(client, key, w["id"]) if e["kind"] == "health"], timeout=15
    )
    assert "Xid 13 (graphics engine exception" in notice[0]["reason"]
    assert notice[0]["details"]["action"] == "none"
    assert state(client, key, w["id"])["state"] == "running"
    assert health(session, node, 2) == "healthy"


def test_a_warning_makes_the_gpu_suspect_and_checkpointing_work_moves_at_its_checkpoint(
    setup, session
):
    client, key, op = setup
    w = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 8, "checkpoint": {"interval_s": 300}},
        headers=auth(key),
    ).json()
    [node] = {p["node"] for p in running(client, key, w["id"])["placement"]}
    _xid(client, op, node, 5, 92)
    wait_until(lambda: health(session, node, 5) == "suspect", timeout=15)
    [notice] = [e for e in _events(client, key, w["id"]) if e["kind"] == "health"]
    assert "moves to healthy GPUs at its next checkpoint" in notice["reason"]
    assert state(client, key, w["id"])["state"] == "running"
    # Its next checkpoint: healthy capacity exists, so it moves, ahead of its peers.
    r = client.post(
        f"/v1/workloads/{w['id']}/checkpoints", json={"size_bytes": 1024}, headers=auth(key)
    )
    assert r.status_code in (200, 201, 204), r.text
    wait_until(
        lambda: (
            "moved at its checkpoint"
            in " ".join(e["reason"] for e in _events(client, key, w["id"]))
        ),
        timeout=15,
    )
    again = running(client, key, w["id"])
    assert all(not (p["node"] == node and 5 in p["gpu_indices"]) for p in again["placement"])


def test_a_gpu_that_faults_again_after_its_reset_goes_out_of_service(setup, session):
    client, key, op = setup
    _xid(client, op, "h2", 6, 48)
    wait_until(lambda: history(session, "h2", 6)[-1:] == ["healthy"], timeout=20)
    assert history(session, "h2", 6) == ["quarantined", "repairing", "validating", "healthy"]
    assert health(session, "h2") == "healthy"  # a reset leaves the node alone
    # The gauge clears (no signal), then the same fault again.
    assert (
        push(client, op, exporter_text("h2", {"DCGM_FI_DEV_XID_ERRORS": {6: 0}})).json()["signals"]
        == 0
    )
    _xid(client, op, "h2", 6, 48)
    wait_until(lambda: health(session, "h2", 6) == "out_of_service", timeout=15)
    session.rollback()
    why = session.execute(text("SELECT cause FROM health_events ORDER BY id DESC LIMIT 1")).scalar()
    assert "faulted again after a repair" in why


def test_a_slow_rank_points_at_its_gpu(setup, session):
    client, key, _op = setup
    gang = client.post(
        "/v1/workloads", json={"kind": "job", "gpus": 8, "replicas": 2}, headers=auth(key)
    ).json()
    w = running(client, key, gang["id"])
    steps = [{"rank": r, "step_time_s": 1.0} for r in range(16)]
    steps[11]["step_time_s"] = 1.25
    r = client.post(
        f"/v1/workloads/{gang['id']}/progress", json={"ranks": steps}, headers=auth(key)
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "ranks": 16,
        "slow_ranks": [11],
        "unknown_ranks": [],
        "noisy_neighbour": False,
    }
    replica = next(p for p in w["placement"] if p["replica"] == 1)
    session.rollback()
    perf = session.execute(
        text(
            "SELECT g.perf FROM gpus g JOIN nodes n ON n.id = g.node_id "
            "WHERE n.name = :n AND g.index = :g"
        ),
        {"n": replica["node"], "g": replica["gpu_indices"][3]},
    ).scalar()
    assert perf == pytest.approx(0.8)
    bad = client.post(
        f"/v1/workloads/{gang['id']}/progress",
        json={"ranks": [{"rank": 0, "step_time_s": 1}, {"rank": 16, "step_time_s": 1}]},
        headers=auth(key),
    )
    assert bad.status_code == 200 and bad.json()["unknown_ranks"] == [16]
