"""A victim's grace period on real PostgreSQL, Redis and Celery workers: the preemptor starts only
once the victim has stopped, even when the worker holding the victim's stop is SIGKILLed; a
process that exits during its grace (an agent's report, or a simulated run reaching its length)
ends `succeeded`, never requeued, and its GPUs go to the preemptor at once."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from datetime import datetime, timedelta

from sqlalchemy import text

from tests.fixtures.harness import ROOT, RUN_ID
from tests.fixtures.processes import kill
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth, wait_until

# A 4 s checkpoint stretches the victims' grace from the suite's 1 s to 4 s (checkpoint_wait).
LOW = {
    "kind": "instance",
    "gpus": 8,
    "priority": "preemptible",
    "checkpoint": {"interval_s": 600, "cost_s": 4},
}
HIGH = {"kind": "instance", "gpus": 8, "priority": "production"}


def _get(client, key, wid) -> dict:
    return client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()


def _in(client, key, wid, *states, timeout=30.0) -> dict:
    return wait_until(lambda: (w := _get(client, key, wid))["state"] in states and w, timeout)


def _transitions(session, wid) -> list[tuple[str, datetime, dict]]:
    session.rollback()
    return list(
        session.execute(
            text(
                "SELECT to_state, at, details FROM workload_events "
                "WHERE workload_id = :w AND kind = 'transition' ORDER BY seq"
            ),
            {"w": wid},
        ).all()
    )


def _eviction(session, victim) -> tuple[datetime, datetime]:
    """When the victim was evicted, and its deadline."""
    at, details = next((a, d) for s, a, d in _transitions(session, victim) if s == "checkpointing")
    return at, datetime.fromisoformat(details["deadline"])


def _stopped(session, victim) -> datetime | None:
    """When the evicted victim stopped: its first transition after `checkpointing`."""
    evs = _transitions(session, victim)
    i = next(i for i, (s, _, _) in enumerate(evs) if s == "checkpointing")
    return evs[i + 1][1] if i + 1 < len(evs) else None


def _provisioned(session, wid) -> datetime:
    return next(a for s, a, _ in _transitions(session, wid) if s == "provisioning")


def _provisioning_worker(name: str) -> subprocess.Popen:
    from workers.settings import worker_command

    log = open(os.path.join(os.environ["RACKPLANE_DATA_DIR"], f"{name}.log"), "wb")
    return subprocess.Popen(
        worker_command(f"{name}-{RUN_ID}@%h", loglevel="WARNING", queues=("provisioning",)),
        cwd=ROOT,
        env=dict(os.environ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def test_a_sigkilled_worker_during_the_grace_does_not_start_the_preemptor_early(
    client, world, session, celery_worker_process
):
    """The worker holding the victim's stop (and the preemptor's start) is SIGKILLed during the
    grace: both messages are gone for the broker's visibility timeout. The preemptor's start,
    sent again after the deadline (a redelivery, a reconcile), waits for the victim to stop."""
    from app.outbox.service import publish
    from app.workloads.tasks import reconcile
    from workers.celery_app import celery_app

    world.fleet(fleet(1))
    ka, kb = world.key(world.tenant("a", policy=ALL)), world.key(world.tenant("b", policy=ALL))
    low = client.post("/v1/workloads", json=LOW, headers=auth(ka)).json()["id"]
    _in(client, ka, low, "running")
    name = f"gracekill-{RUN_ID}@{socket.gethostname()}"
    others = [n for reply in celery_app.control.ping(timeout=2) for n in reply if n != name]
    # Only the worker to be killed takes the grace's follow-ups (the session's keeps placing).
    celery_app.control.cancel_consumer("provisioning", destination=others, reply=True)
    victim_worker = _provisioning_worker("gracekill")
    try:
        wait_until(lambda: celery_app.control.ping(destination=[name]))
        high = client.post("/v1/workloads", json=HIGH, headers=auth(kb)).json()["id"]
        _in(client, ka, low, "checkpointing", timeout=10)
        _, deadline = _eviction(session, low)

        def holds_the_stop():
            got = celery_app.control.inspect(destination=[name]).scheduled()
            return "workloads.finish_preemption" in str(got)

        wait_until(holds_the_stop, timeout=5)
        kill(victim_worker)
        assert _get(client, ka, low)["state"] == "checkpointing"  # killed inside the grace
    finally:
        kill(victim_worker)
        celery_app.control.add_consumer("provisioning", destination=others, reply=True)
    time.sleep(max(0.0, (deadline - datetime.now(deadline.tzinfo)).total_seconds()) + 0.3)
    publish("workloads.provision", kwargs={"workload_ids": [high]}, queue="provisioning")

    def high_started():
        reconcile()  # what beat runs
        return _get(client, kb, high)["state"] in ("provisioning", "running")

    wait_until(high_started, timeout=30, interval=0.5)
    stopped, started = _stopped(session, low), _provisioned(session, high)
    assert stopped is not None and started >= stopped, (
        f"the preemptor was provisioned at {started}, the victim stopped at {stopped}"
    )
    assert stopped - deadline < timedelta(seconds=10)  # found promptly, not after 30 s
    _in(client, kb, high, "running")


def test_an_exit_reported_during_the_grace_succeeds_and_frees_the_gpus(
    client, world, session, celery_worker_process
):
    world.fleet(fleet(1))
    ka, kb = world.key(world.tenant("a", policy=ALL)), world.key(world.tenant("b", policy=ALL))
    op = world.key(None)
    low = client.post("/v1/workloads", json=LOW, headers=auth(ka)).json()["id"]
    _in(client, ka, low, "running")
    high = client.post("/v1/workloads", json=HIGH, headers=auth(kb)).json()["id"]
    _in(client, ka, low, "checkpointing", timeout=10)
    evicted, deadline = _eviction(session, low)
    r = client.post(f"/v1/admin/workloads/{low}/exit", json={"exit_code": 0}, headers=auth(op))
    assert r.status_code == 200, r.text
    w = r.json()
    assert w["state"] == "succeeded"
    exited = datetime.fromisoformat(w["finished_at"])
    assert evicted <= exited < deadline
    [(last, at, details)] = _transitions(session, low)[-1:]
    assert (last, at, details) == ("succeeded", exited, {"exit_code": 0, "cause": "exited"})
    # Its usage ended when its GPUs went to the preemptor, never after the exit.
    session.rollback()
    stops = session.execute(
        text("SELECT occurred_at FROM usage_events WHERE workload_id = :w AND kind = 'stop'"),
        {"w": low},
    ).all()
    assert len(stops) == 1 and stops[0][0] <= exited
    # The GPUs are free: the preemptor starts now, not at the end of the grace.
    _in(client, kb, high, "running")
    assert exited <= _provisioned(session, high) < deadline
    again = client.post(f"/v1/admin/workloads/{low}/exit", json={"exit_code": 0}, headers=auth(op))
    assert again.status_code == 409 and again.json()["code"] == "workload_not_running"
    assert again.headers["content-type"].startswith("application/problem+json")


def test_a_simulated_run_that_ends_during_its_grace_succeeds(
    client, world, session, celery_worker_process
):
    world.fleet(fleet(1))
    ka, kb = world.key(world.tenant("a", policy=ALL)), world.key(world.tenant("b", policy=ALL))
    low = client.post("/v1/workloads", json={**LOW, "run_for_s": 3}, headers=auth(ka)).json()["id"]
    started = datetime.fromisoformat(_in(client, ka, low, "running")["started_at"])
    high = client.post("/v1/workloads", json=HIGH, headers=auth(kb)).json()["id"]
    _in(client, ka, low, "checkpointing", timeout=2)
    _, deadline = _eviction(session, low)
    assert deadline > started + timedelta(seconds=3)  # the run ends inside the grace
    done = _in(client, ka, low, "succeeded", "failed", "queued", "placing", timeout=15)
    states = [s for s, _, _ in _transitions(session, low)]
    assert done["state"] == "succeeded", states
    assert states[-3:] == ["running", "checkpointing", "succeeded"]
    assert datetime.fromisoformat(done["finished_at"]) - started == timedelta(seconds=3)
    assert done["preemptions"] == 0
    _in(client, kb, high, "running")
    assert _provisioned(session, high) < deadline  # its GPUs were free when the run ended
