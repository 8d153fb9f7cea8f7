"""The health loop's decisions on a real database: bursts grouped into incidents, the circuit
breaker, a silent node agent, operators' hands. (The worker runs what they enqueue.)"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select, text

from app.core.config import get_settings
from app.core.db import session_scope
from app.health.repairs import repair_step
from app.models.health import HealthIncident
from tests.fixtures.health import exporter_text, health, history, push, xid_burst
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth, wait_until

FLEET = fleet(3)


def _incidents(session):
    session.rollback()
    return session.scalars(select(HealthIncident).order_by(HealthIncident.opened_at)).all()


def test_a_burst_is_one_incident_classified_by_its_worst_code(world, session):
    world.fleet(FLEET)
    t0 = time.time() - 2000
    window = get_settings().incident_window_seconds
    xid_burst("h1", (0, 13, t0))
    xid_burst("h1", (1, 43, t0 + 50), (1, 48, t0 + 60))  # within the window: the same incident
    [inc] = _incidents(session)
    assert (inc.code, inc.action, inc.signal_count) == (48, "reset_gpu", 3)
    assert inc.gpu_indices == [0, 1]  # (the sweep may have marked it closed: it still joins)
    assert [s["code"] for s in inc.signals] == [13, 43, 48]
    # A milder code later in the burst does not lower its class.
    xid_burst("h1", (2, 13, t0 + 100))
    [inc] = _incidents(session)
    assert inc.code == 48 and inc.signal_count == 4
    # The window passed without a signal: a new incident; the first one is closed.
    xid_burst("h1", (0, 31, t0 + 100 + window + 1))
    first, second = _incidents(session)
    assert first.state == "closed" and second.code == 31 and second.action == "none"
    # Another node's signal is another incident.
    xid_burst("h2", (0, 13, t0 + 120))
    assert len(_incidents(session)) == 3


def test_the_circuit_breaker_stops_automatic_quarantine_past_its_share(world, session, monkeypatch):
    world.fleet(FLEET)  # 24 GPUs in region r1, rack hgx-1
    s = get_settings()
    monkeypatch.setattr(s, "breaker_min_gpus", 0)
    monkeypatch.setattr(s, "breaker_region_share", 0.34)  # 8 of 24
    now = time.time()
    out = xid_burst("h1", (0, 79, now))  # a reboot takes h1's 8 GPUs: at the limit
    assert out.held_back is None
    assert history(session, "h1")[:1] == ["quarantined"]
    out = xid_burst("h2", (4, 79, now))
    assert out.held_back and "circuit breaker: 8 of 24 GPUs of region r1" in out.held_back
    assert health(session, "h2") == "healthy"  # nothing more drained
    assert health(session, "h2", 4) == "suspect"  # but watched, and raised to operators
    out = xid_burst("h3", (1, 48, now))
    assert out.held_back and health(session, "h3", 1) == "suspect"
    held = [i for i in _incidents(session) if i.held_back]
    assert len(held) == 2
    # A rack limit holds on its own too.
    monkeypatch.setattr(s, "breaker_region_share", 1.0)
    monkeypatch.setattr(s, "breaker_rack_share", 0.34)
    out = xid_burst("h3", (2, 48, now + 1))
    assert out.held_back and "rack hgx-1" in out.held_back


def test_a_silent_node_is_unreachable_its_work_moves_and_it_returns_when_it_reports(
    client, world, session, celery_worker_process, monkeypatch
):
    from app.health import tasks

    world.fleet(fleet(2))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key))
    wid = w.json()["id"]
    running = wait_until(
        lambda: (
            (x := client.get(f"/v1/workloads/{wid}", headers=auth(key)).json())["state"]
            == "running"
            and x
        )
    )
    [node] = {p["node"] for p in running["placement"]}
    # It has an agent: its reports come as a stream (a third of the heartbeat timeout apart,
    # over two thirds of it; a short timeout here), not one push.
    s = get_settings()
    timeout = s.heartbeat_timeout_seconds
    monkeypatch.setattr(s, "heartbeat_timeout_seconds", 0.9)
    for _ in range(3):
        body = exporter_text(node, {"DCGM_FI_DEV_GPU_TEMP": {0: 40}})
        assert push(client, op, body).status_code == 200
        time.sleep(0.35)
    monkeypatch.setattr(s, "heartbeat_timeout_seconds", timeout)
    # Its agent goes silent: the last report is older than the heartbeat timeout.
    session.execute(text("UPDATE node_heartbeats SET last_seen_at = now() - interval '1 hour'"))
    session.commit()
    tasks.sweep()
    wait_until(lambda: health(session, node) == "unreachable", timeout=15)
    moved = wait_until(
        lambda: (
            (x := client.get(f"/v1/workloads/{wid}", headers=auth(key)).json())["interruptions"]
            == 1
            and x
        ),
        timeout=15,
    )
    assert moved["expedited"] or moved["state"] == "running"
    # The provider power-cycles it; without a report after that, it stays out.
    wait_until(lambda: "repairing" in history(session, node), timeout=15)
    wait_until(lambda: history(session, node)[-1:] == ["unreachable"], timeout=15)
    # The agent reports again: validated, then healthy.
    assert (
        push(client, op, exporter_text(node, {"DCGM_FI_DEV_GPU_TEMP": {0: 40}})).status_code == 200
    )
    tasks.sweep()
    wait_until(lambda: health(session, node) == "healthy", timeout=15)
    assert history(session, node)[-2:] == ["validating", "healthy"]


@pytest.mark.parametrize(
    ("code", "gpu_path", "node_path"),
    [
        (13, [], []),  # application error: only the owner is told
        (92, ["suspect"], []),  # watch
        (48, ["quarantined", "repairing"], []),  # drain and reset the GPU
        (79, ["quarantined", "repairing"], ["quarantined", "repairing"]),  # reboot the node
        (74, ["quarantined", "repairing"], []),  # NVLink: the domain's work stops, GPU reset
        (64, ["out_of_service"], []),  # service
    ],
)
def test_every_class_of_row_is_carried_out(world, session, code, gpu_path, node_path):
    """Each action of the table on an idle node (nothing to drain): the GPU's and the node's
    first steps (a running worker may carry the repairs further)."""
    world.fleet(FLEET)
    out = xid_burst("h1", (3, code, time.time()))
    assert out.stopped == 0
    assert history(session, "h1", 3)[: len(gpu_path)] == gpu_path
    assert len(history(session, "h1", 3)) >= len(gpu_path)
    assert history(session, "h1")[: len(node_path)] == node_path
    if not node_path:
        assert history(session, "h1") == []
    if not gpu_path:
        assert history(session, "h1", 3) == []


def test_a_failed_repair_takes_the_gpu_out_of_service(world, session, monkeypatch):
    from datetime import timedelta

    from app.core.db import utcnow
    from app.models.health import HealthRepair

    world.fleet(FLEET)
    s = get_settings()
    monkeypatch.setattr(s, "sim_reset_seconds", 3600.0)  # no worker gets to it first
    xid_burst("h3", (5, 95, time.time()))
    assert history(session, "h3", 5) == ["quarantined", "repairing"]
    session.rollback()
    rep = session.scalars(select(HealthRepair)).one()
    assert rep.kind == "reset" and rep.gpu_indices == [5]
    rep.due_at = utcnow() - timedelta(seconds=1)
    session.commit()
    monkeypatch.setattr(s, "sim_repair_fail_rate", 1.0)  # the provider's reset fails
    with session_scope() as db:
        assert repair_step(db, rep.id) == "failed"
    assert history(session, "h3", 5)[-1] == "out_of_service"
    session.rollback()
    cause = session.execute(
        text("SELECT cause FROM health_events ORDER BY id DESC LIMIT 1")
    ).scalar()
    assert cause == "the GPU reset failed"
