"""Jobs end (real PostgreSQL, Redis and a Celery worker): a simulated run that declares its
length exits 0 and succeeds; a node agent reports an exit through the API (0 succeeds,
anything else fails, with its code); a run past its max_runtime_s is stopped and fails with a
clear reason, even when the message that should have stopped it was lost. In each case the
allocations end, and with them the usage, at the moment the run ended."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from sqlalchemy import text

from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth, wait_until

FLEET = fleet(2)  # two HGX H100 nodes, h1 and h2


def _get(client, key, wid):
    return client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()


def _state_is(client, key, wid, state, timeout=30):
    return wait_until(lambda: (w := _get(client, key, wid))["state"] == state and w, timeout)


def _usage_stops(session, wid) -> list[datetime]:
    session.rollback()
    return [
        at
        for (at,) in session.execute(
            text("SELECT occurred_at FROM usage_events WHERE workload_id = :w AND kind = 'stop'"),
            {"w": wid},
        )
    ]


def test_a_simulated_run_of_declared_length_succeeds(client, world, session, celery_worker_process):
    world.fleet(FLEET)
    key = world.key(world.tenant("acme", policy=ALL))
    r = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 4, "replicas": 2, "run_for_s": 2},
        headers=auth(key),
    )
    assert r.status_code == 201, r.text
    wid = r.json()["id"]
    running = _state_is(client, key, wid, "running")
    done = _state_is(client, key, wid, "succeeded")
    started = datetime.fromisoformat(running["started_at"])
    finished = datetime.fromisoformat(done["finished_at"])
    assert finished - started == timedelta(seconds=2)
    events = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
    assert events[-1]["details"]["exit_code"] == 0
    stops = _usage_stops(session, wid)
    assert len(stops) == 2 and {s.replace(tzinfo=None) for s in stops} == {
        finished.replace(tzinfo=None)
    }  # both replicas stop metering when the run ended


def test_a_node_agent_reports_an_exit(client, world, session, celery_worker_process):
    world.fleet(FLEET)
    key = world.key(world.tenant("acme", policy=ALL))
    op = world.key(None)
    wid = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)
    ).json()["id"]
    _state_is(client, key, wid, "running")
    denied = client.post(
        f"/v1/admin/workloads/{wid}/exit", json={"exit_code": 0}, headers=auth(key)
    )
    assert denied.status_code == 403
    r = client.post(
        f"/v1/admin/workloads/{wid}/exit",
        json={"exit_code": 3, "message": "CUDA error: out of memory"},
        headers=auth(op),
    )
    assert r.status_code == 200, r.text
    w = r.json()
    assert w["state"] == "failed"
    ev = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"][-1]
    assert ev["details"] == {"exit_code": 3, "cause": "exited_nonzero"}
    assert "code 3: CUDA error" in ev["reason"]
    assert len(_usage_stops(session, wid)) == 1
    again = client.post(f"/v1/admin/workloads/{wid}/exit", json={"exit_code": 0}, headers=auth(op))
    assert again.status_code == 409 and again.json()["code"] == "workload_not_running"


def test_a_run_past_its_max_runtime_is_stopped_even_if_the_message_was_lost(
    client, world, session, celery_worker_process
):
    from app.workloads.tasks import reconcile

    world.fleet(FLEET)
    key = world.key(world.tenant("acme", policy=ALL))
    wid = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 1, "max_runtime_s": 60},
        headers=auth(key),
    ).json()["id"]
    running = _state_is(client, key, wid, "running")
    deadline = datetime.fromisoformat(running["run_deadline_at"])
    assert deadline - datetime.fromisoformat(running["started_at"]) == timedelta(seconds=60)
    # As if its expire message was lost and the deadline passed: the reconciler finds it.
    time.sleep(7)
    past = datetime.now(deadline.tzinfo) - timedelta(seconds=6)
    session.execute(
        text("UPDATE workloads SET run_deadline_at = :d WHERE id = :w"), {"d": past, "w": wid}
    )
    session.commit()
    assert reconcile() >= 1
    done = _state_is(client, key, wid, "failed")
    ev = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"][-1]
    assert ev["details"]["cause"] == "max_runtime_exceeded"
    assert ev["reason"] == "stopped: ran past its max_runtime_s (60 s)"
    # Billing stops at the deadline, not when the stop ran.
    [stop] = _usage_stops(session, wid)
    assert abs((stop - past).total_seconds()) < 0.01
    assert datetime.fromisoformat(done["finished_at"]) == stop
