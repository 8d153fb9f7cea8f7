"""Chaos experiments on a real deployment (PostgreSQL, Redis, a Celery worker): faults arrive
through the telemetry path, the blast radius is checked before anything is injected, and the
report says what the health loop did and whether the invariants held."""

from __future__ import annotations

import pytest

from app.core.config import get_settings
from tests.fixtures.health import health
from tests.fixtures.workloads import ALL, fleet, running
from tests.fixtures.world import auth, wait_until

RADIUS = {"max_gpus": 8, "max_region_share": 0.5}


def _start(client, op, faults, radius=RADIUS):
    return client.post(
        "/v1/admin/chaos/experiments",
        json={"name": "game day", "faults": faults, "blast_radius": radius},
        headers=auth(op),
    )


def test_an_xid_experiment_moves_the_gang_and_reports_each_step(
    client, world, session, celery_worker_process
):
    world.fleet(fleet(3))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    gang = client.post(
        "/v1/workloads", json={"kind": "job", "gpus": 8, "replicas": 2}, headers=auth(key)
    ).json()
    w = running(client, key, gang["id"])
    node = w["placement"][0]["node"]
    r = _start(client, op, [{"kind": "xid", "code": 79, "target": {"node": node, "gpu": 3}}])
    assert r.status_code == 201, r.text
    exp = r.json()
    assert exp["gpus_touched"] == 8 and exp["state"] == "running"

    def done():
        x = client.get(f"/v1/admin/chaos/experiments/{exp['id']}", headers=auth(op)).json()
        return x["report"][0]["running_s"] is not None and x

    rep = wait_until(done, timeout=30)
    [fault] = rep["report"]
    assert fault["action"] == "reboot_node" and fault["workloads"] == [gang["id"]]
    assert 0 <= fault["detect_s"] <= fault["quarantine_s"] <= fault["requeue_s"] < 5
    assert fault["requeue_s"] <= fault["running_s"] < 30
    assert rep["held"] is True and rep["invariants"]["usage_after_fault"] == 0
    # Stop: the Xid gauge clears (no new fault); the loop's repair goes on by itself.
    r = client.post(f"/v1/admin/chaos/experiments/{exp['id']}/stop", headers=auth(op))
    assert r.json()["state"] == "stopped" and r.json()["injections"][0]["undone_at"]
    assert health(session, node) in ("repairing", "validating", "healthy", "unreachable")


def test_random_targets_and_an_ecc_fault(client, world, session, celery_worker_process):
    world.fleet(fleet(2))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)).json()
    [p] = running(client, key, w["id"])["placement"]
    target = {"random_gpus": 1, "holding_tier": "dedicated"}
    r = _start(client, op, [{"kind": "ecc_dbe", "target": target}])
    assert r.status_code == 201, r.text
    [inj] = r.json()["injections"]
    assert (inj["node"], inj["gpu_index"]) == (p["node"], p["gpu_indices"][0])
    wait_until(lambda: health(session, p["node"], p["gpu_indices"][0]) != "healthy", timeout=15)
    r = _start(client, op, [{"kind": "ecc_dbe", "target": {**target, "random_gpus": 5}}])
    assert r.status_code == 409 and r.json()["code"] == "not_enough_targets"


def test_the_blast_radius_is_checked_before_anything_is_injected(client, world, session):
    world.fleet(fleet(2))  # 16 GPUs
    op = world.key(None)
    reboot = {"kind": "xid", "code": 79, "target": {"node": "h1", "gpu": 0}}
    r = _start(client, op, [reboot], {"max_gpus": 4, "max_region_share": 1})
    assert r.status_code == 409 and r.json()["code"] == "blast_radius_exceeded"
    assert "8 GPUs out" in r.json()["detail"]
    r = _start(client, op, [reboot], {"max_gpus": 100, "max_region_share": 0.25})
    assert r.status_code == 409 and "8 of region r1's 16" in r.json()["detail"]
    # An application error touches its one GPU and takes nothing out.
    app_err = {"kind": "xid", "code": 13, "target": {"node": "h1", "gpu": 0}}
    assert (
        _start(client, op, [app_err], {"max_gpus": 1, "max_region_share": 0.1}).status_code == 201
    )
    assert health(session, "h1") == "healthy"
    r = _start(client, op, [{"kind": "xid", "code": 48, "target": {"node": "h9", "gpu": 0}}])
    assert r.status_code == 404 and r.json()["code"] == "unknown_target"


def test_chaos_is_off_unless_enabled(client, world, monkeypatch):
    world.fleet(fleet(1))
    op = world.key(None)
    monkeypatch.setattr(get_settings(), "chaos_enabled", False)
    r = _start(client, op, [{"kind": "xid", "code": 79, "target": {"node": "h1", "gpu": 0}}])
    assert r.status_code == 403 and r.json()["code"] == "chaos_disabled"


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "xid", "target": {"node": "h1", "gpu": 0}},
        {"kind": "ecc_dbe", "code": 3, "target": {"random_gpus": 1}},
        {"kind": "provider", "fails": "power", "target": {"node": "h1"}},
        {"kind": "nvlink", "target": {"random_gpus": 2}},
    ],
)
def test_malformed_faults_are_named(client, world, body):
    world.fleet(fleet(1))
    op = world.key(None)
    r = _start(client, op, [body])
    assert r.status_code == 422 and r.json()["code"] == "validation_error"


def test_the_cli_runs_an_experiment_within_its_radius_and_reports_it(
    world, session, celery_worker_process
):
    import json
    import os
    import subprocess
    import sys

    from tests.fixtures.harness import ROOT

    world.fleet(fleet(2))

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "app.cli", "chaos", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )

    r = cli(
        "inject", "--xid", "79", "--node", "h1", "--gpu", "2", "--max-gpus", "4", "--max-share", "1"
    )
    assert r.returncode == 2 and "blast radius allows 4" in r.stderr
    r = cli(
        "inject",
        "--xid",
        "48",
        "--node",
        "h1",
        "--gpu",
        "2",
        "--max-gpus",
        "1",
        "--max-share",
        "0.1",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    exp = json.loads(r.stdout)
    assert exp["gpus_touched"] == 1 and exp["injections"][0]["gpu_index"] == 2
    wait_until(lambda: health(session, "h1", 2) != "healthy", timeout=15)
    rep = cli("report", exp["id"])
    assert rep.returncode == 0 and "reset_gpu" in rep.stdout and "invariants held" in rep.stdout
    assert "stopped" in cli("stop", exp["id"]).stdout
    session.rollback()
    from sqlalchemy import text

    actions = (
        session.execute(
            text("SELECT action FROM audit_log WHERE target_id = :e ORDER BY created_at"),
            {"e": exp["id"]},
        )
        .scalars()
        .all()
    )
    # The start and its first round share a transaction (and a timestamp).
    assert sorted(actions[:2]) == ["chaos.inject", "chaos.start"] and actions[2:] == ["chaos.stop"]


def test_a_throttled_gpu_becomes_slow_and_suspect_through_its_telemetry(
    client, world, session, celery_worker_process
):
    from sqlalchemy import text

    world.fleet(fleet(1))
    op = world.key(None)
    r = _start(client, op, [{"kind": "throttle", "speed": 0.7, "target": {"node": "h1", "gpu": 6}}])
    assert r.status_code == 201, r.text
    assert r.json()["gpus_touched"] == 1
    wait_until(lambda: health(session, "h1", 6) == "suspect", timeout=15)
    session.rollback()
    perf = session.execute(
        text(
            "SELECT g.perf FROM gpus g JOIN nodes n ON n.id = g.node_id "
            "WHERE n.name = 'h1' AND g.index = 6"
        )
    ).scalar()
    assert perf == pytest.approx(0.7)
    rep = client.get(f"/v1/admin/chaos/experiments/{r.json()['id']}", headers=auth(op)).json()
    assert rep["report"][0]["action"] == "watch" and rep["report"][0]["quarantine_s"] is not None


def test_abort_conditions_stop_the_experiment_and_undo_it(
    client, world, session, celery_worker_process
):
    from app.chaos.tasks import watch

    world.fleet(fleet(2))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    radius = {"max_gpus": 2, "max_region_share": 0.5}
    # Capacity floor: 16 idle GPUs asked for; a reset takes one out.
    r = client.post(
        "/v1/admin/chaos/experiments",
        json={
            "name": "floor",
            "blast_radius": radius,
            "abort": {"min_idle_gpus": 16},
            "faults": [{"kind": "xid", "code": 48, "target": {"node": "h1", "gpu": 0}}],
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    floor = r.json()["id"]
    # Failed workloads: none allowed.
    r = client.post(
        "/v1/admin/chaos/experiments",
        json={
            "name": "fails",
            "blast_radius": radius,
            "abort": {"max_failed_workloads": 0},
            "faults": [{"kind": "xid", "code": 13, "target": {"node": "h2", "gpu": 1}}],
        },
        headers=auth(op),
    )
    fails = r.json()["id"]
    wait_until(lambda: health(session, "h1", 0) != "healthy", timeout=15)
    watch()  # (the beat may have run it first: the same check)
    got = client.get(f"/v1/admin/chaos/experiments/{floor}", headers=auth(op)).json()
    assert (
        got["state"] == "aborted"
        and "idle healthy GPUs left (the floor is 16)" in got["abort_reason"]
    )
    assert (
        client.get(f"/v1/admin/chaos/experiments/{fails}", headers=auth(op)).json()["state"]
        == "running"
    )
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
    running(client, key, w.json()["id"])
    r = client.post(
        f"/v1/admin/workloads/{w.json()['id']}/exit", json={"exit_code": 1}, headers=auth(op)
    )
    assert r.status_code == 200, r.text
    watch()
    got = client.get(f"/v1/admin/chaos/experiments/{fails}", headers=auth(op)).json()
    assert got["state"] == "aborted" and "1 workloads failed" in got["abort_reason"]
    assert got["injections"][0]["undone_at"] is not None


def _last_seen(session, node):
    from sqlalchemy import text

    session.rollback()
    return session.execute(
        text(
            "SELECT b.last_seen_at FROM node_heartbeats b JOIN nodes n ON n.id = b.node_id "
            "WHERE n.name = :n"
        ),
        {"n": node},
    ).scalar()


def test_node_loss_silences_the_agent_until_the_experiment_stops(
    client, world, session, celery_worker_process
):
    from sqlalchemy import text

    world.fleet(fleet(2))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key)).json()
    node = running(client, key, w["id"])["placement"][0]["node"]
    r = _start(client, op, [{"kind": "node_loss", "target": {"node": node}}])
    assert r.status_code == 201, r.text
    exp = r.json()
    assert exp["gpus_touched"] == 8 and exp["injections"][0]["gpu_index"] is None
    # The experiment spoke for the agent a last time; what the agent sends now is lost.
    seen = _last_seen(session, node)
    assert seen is not None
    r = client.post("/v1/admin/telemetry", json={"samples": [], "nodes": [node]}, headers=auth(op))
    assert r.status_code == 200, r.text
    assert _last_seen(session, node) == seen
    # An hour passes, more than the heartbeat timeout (the experiment and the last report
    # move back together): the sweep finds the node silent.
    for sql in (
        "UPDATE node_heartbeats SET last_seen_at = last_seen_at - interval '1 hour' "
        "WHERE node_id = (SELECT id FROM nodes WHERE name = :n)",
        "UPDATE chaos_experiments SET started_at = started_at - interval '1 hour'",
        "UPDATE chaos_injections SET injected_at = injected_at - interval '1 hour'",
    ):
        session.execute(text(sql), {"n": node})
    session.commit()
    wait_until(lambda: health(session, node) == "unreachable", timeout=15)

    def moved():
        x = client.get(f"/v1/admin/chaos/experiments/{exp['id']}", headers=auth(op)).json()
        return x["report"][0]["running_s"] is not None and x

    rep = wait_until(moved, timeout=30)
    assert rep["report"][0]["action"] == "reboot_node"
    assert rep["report"][0]["workloads"] == [w["id"]] and rep["held"] is True
    other = running(client, key, w["id"])["placement"][0]["node"]
    assert other != node
    # Stopped: the network is back, the agent's report arrives, the node validates and returns.
    r = client.post(f"/v1/admin/chaos/experiments/{exp['id']}/stop", headers=auth(op))
    assert r.json()["state"] == "stopped"
    assert _last_seen(session, node) > seen
    wait_until(lambda: health(session, node) == "healthy", timeout=20)


def test_nvlink_errors_drain_an_nvl72_domain_within_the_breaker(
    client, world, session, celery_worker_process
):
    from sqlalchemy import text

    world.fleet("regions: [{name: r1, racks: [{name: nvl-1, kind: nvl72, block: s1}]}]")
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    gang = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 4,
            "replicas": 2,
            "gpu_models": ["GB200"],
            "topology": {"level": "nvlink_domain", "mode": "required"},
        },
        headers=auth(key),
    ).json()
    node = running(client, key, gang["id"])["placement"][0]["node"]
    fault = {"kind": "nvlink", "target": {"node": node}}
    r = _start(client, op, [fault], {"max_gpus": 71, "max_region_share": 1})
    assert r.status_code == 409 and "72 GPUs out" in r.json()["detail"]
    r = _start(client, op, [fault], {"max_gpus": 72, "max_region_share": 1})
    assert r.status_code == 201, r.text
    exp = r.json()
    assert exp["gpus_touched"] == 72 and len(exp["injections"]) == 18

    def acted():
        x = client.get(f"/v1/admin/chaos/experiments/{exp['id']}", headers=auth(op)).json()
        return all(f["incident"] for f in x["report"]) and x

    rep = wait_until(acted, timeout=30)
    assert {f["action"] for f in rep["report"]} == {"drain_nvlink_domain"}
    stopped = [f for f in rep["report"] if f["workloads"]]
    assert [f["workloads"] for f in stopped] == [[gang["id"]]]
    # The circuit breaker holds: at most half the rack's GPUs taken out automatically.
    session.rollback()
    out = session.execute(
        text("SELECT count(*) FROM gpus WHERE health NOT IN ('healthy', 'suspect')")
    ).scalar()
    nodes_out = session.execute(
        text("SELECT count(*) FROM nodes WHERE health NOT IN ('healthy', 'suspect')")
    ).scalar()
    assert 0 < out + 4 * nodes_out <= 36 + 4
    assert rep["invariants"]["breaker_exceeded"] == 0 and rep["held"] is True


def test_a_provider_that_fails_to_repair_sends_the_gpu_out_of_service(
    client, world, session, celery_worker_process
):
    from sqlalchemy import text

    world.fleet(fleet(2))
    op = world.key(None)
    faults = [
        {"kind": "provider", "fails": "repair", "target": {"node": "h1"}},
        {"kind": "xid", "code": 48, "target": {"node": "h1", "gpu": 0}},
    ]
    r = _start(client, op, faults)
    assert r.status_code == 201, r.text
    exp = r.json()
    assert exp["gpus_touched"] == 8
    assert [i["detail"] for i in exp["injections"] if i["kind"] == "provider"] == ["repair"]
    # The reset is tried, fails, and the GPU goes out of service; its neighbours stay in.
    wait_until(lambda: health(session, "h1", 0) == "out_of_service", timeout=20)
    assert health(session, "h1", 1) == "healthy"
    r = client.post(f"/v1/admin/chaos/experiments/{exp['id']}/stop", headers=auth(op))
    assert r.json()["state"] == "stopped"
    session.rollback()
    assert session.execute(text("SELECT count(*) FROM sim_provider_faults")).scalar() == 0


def test_a_provider_that_fails_to_boot_requeues_the_work_until_it_stops(
    client, world, session, celery_worker_process
):
    world.fleet(fleet(1))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    fault = {"kind": "provider", "fails": "boot", "target": {"rack": "hgx-1"}}
    r = _start(client, op, [fault], {"max_gpus": 8, "max_region_share": 1})
    assert r.status_code == 201, r.text
    exp = r.json()
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)).json()

    def report():
        return client.get(f"/v1/admin/chaos/experiments/{exp['id']}", headers=auth(op)).json()

    rep = wait_until(lambda: report()["report"][0]["workloads"] and report(), timeout=30)
    assert rep["report"][0]["workloads"] == [w["id"]] and rep["report"][0]["requeue_s"] >= 0
    assert client.get(f"/v1/workloads/{w['id']}", headers=auth(key)).json()["state"] in (
        "queued",
        "placing",
        "provisioning",
    )
    client.post(f"/v1/admin/chaos/experiments/{exp['id']}/stop", headers=auth(op))
    running(client, key, w["id"])
    rep = wait_until(lambda: report()["report"][0]["running_s"] is not None and report())
    assert rep["held"] is True


def test_a_noisy_neighbour_is_found_from_telemetry_and_its_victim_moves_at_its_checkpoint(
    client, world, session, celery_worker_process
):
    world.fleet(fleet(1))
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    other = world.key(world.tenant("globex", policy=ALL))

    def share(k, milli, **more):
        body = {"kind": "instance", "milli": milli, "gpu_memory_mib": 10240, **more}
        w = client.post("/v1/workloads", json=body, headers=auth(k)).json()
        return running(client, k, w["id"])

    loud = share(key, 600)
    victim = share(key, 300, checkpoint={"interval_s": 600})
    stranger = share(other, 100)
    [lp], [vp], [sp] = loud["placement"], victim["placement"], stranger["placement"]
    # The isolation tiers already keep another tenant off the shared GPU.
    assert (vp["node"], vp["gpu_indices"]) == (lp["node"], lp["gpu_indices"])
    assert sp["gpu_indices"] != lp["gpu_indices"]
    gpu = lp["gpu_indices"][0]
    # A GPU without two sharers has no neighbour to be noisy.
    alone = {"kind": "noisy_neighbour", "target": {"node": "h1", "gpu": sp["gpu_indices"][0]}}
    r = _start(client, op, [alone])
    assert r.status_code == 409 and r.json()["code"] == "not_enough_targets"
    r = _start(client, op, [{"kind": "noisy_neighbour", "target": {"node": "h1", "gpu": gpu}}])
    assert r.status_code == 201, r.text
    exp = r.json()
    assert exp["gpus_touched"] == 1  # the GPU it touches; nothing leaves service

    def report():
        return client.get(f"/v1/admin/chaos/experiments/{exp['id']}", headers=auth(op)).json()

    rep = report()
    [row] = rep["report"]
    assert row["workloads"] == [victim["id"]] and row["detect_s"] is not None
    events = client.get(f"/v1/workloads/{victim['id']}/events", headers=auth(key)).json()
    told = [e for e in events["items"] if e["kind"] == "health"]
    assert told and "noisy neighbour" in told[-1]["reason"] and loud["id"] in told[-1]["reason"]
    assert "moves to another GPU at its next checkpoint" in told[-1]["reason"]
    # The loud one is not told; nor is the other tenant, which never shared the GPU.
    for w, k in ((loud, key), (stranger, other)):
        ev = client.get(f"/v1/workloads/{w['id']}/events", headers=auth(k)).json()["items"]
        assert not [e for e in ev if e["kind"] == "health"]
    # Its checkpoint: it moves, to a GPU other than the noisy one.
    r = client.post(
        f"/v1/workloads/{victim['id']}/checkpoints", json={"size_bytes": 1}, headers=auth(key)
    )
    assert r.status_code in (200, 201), r.text

    def moved():
        x = report()
        return x["report"][0]["running_s"] is not None and x

    rep = wait_until(moved, timeout=30)
    again = running(client, key, victim["id"])["placement"][0]
    assert (again["node"], again["gpu_indices"]) != ("h1", [gpu])
    assert rep["invariants"]["cross_tenant_sharing"] == 0 and rep["held"] is True
    # Step times of a share are judged against its own best pace through the API as well.
    r = client.post(
        f"/v1/workloads/{victim['id']}/progress",
        json={"ranks": [{"rank": 0, "step_time_s": 1.0}]},
        headers=auth(key),
    )
    assert r.status_code == 200 and r.json()["noisy_neighbour"] is False


def test_scheduled_and_repeated_rounds_stay_within_the_blast_radius(client, world, session):
    from datetime import UTC, datetime, timedelta, timezone

    from sqlalchemy import text

    from app.chaos.tasks import watch

    world.fleet(fleet(1))
    op = world.key(None)
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    fault = {"kind": "xid", "code": 13, "target": {"node": "h1", "gpu": 0}}

    def start(max_gpus, schedule, share=1.0):
        r = client.post(
            "/v1/admin/chaos/experiments",
            json={
                "name": f"rounds within {max_gpus}",
                "faults": [fault],
                "blast_radius": {"max_gpus": max_gpus, "max_region_share": share},
                "schedule": schedule,
            },
            headers=auth(op),
        )
        assert r.status_code == 201, r.text
        return r.json()

    tight = start(1, {"at": at, "every_s": 60, "times": 2})
    roomy = start(2, {"at": at, "every_s": 60, "times": 2})
    # 20 % of the region's 8 GPUs: one GPU per round fits, two rounds do not.
    share = start(10, {"at": at, "every_s": 60, "times": 2}, share=0.2)
    # A time with another offset is the same instant.
    there = (datetime.now(UTC) + timedelta(hours=1)).astimezone(timezone(timedelta(hours=2)))
    later = start(1, {"at": there.isoformat()})
    got = datetime.fromisoformat(later["next_at"])
    assert abs((got - there).total_seconds()) < 1
    for e in (tight, roomy, share, later):
        assert e["state"] == "scheduled" and e["rounds"] == 0 and e["injections"] == []
        assert e["next_at"] is not None

    def due():  # the clock reaches the next round
        session.execute(text("UPDATE chaos_experiments SET next_at = now() - interval '1 s'"))
        session.commit()
        watch()

    def get(e):
        return client.get(f"/v1/admin/chaos/experiments/{e['id']}", headers=auth(op)).json()

    # Stopped before its time: nothing is ever injected.
    r = client.post(f"/v1/admin/chaos/experiments/{later['id']}/stop", headers=auth(op))
    assert r.json()["state"] == "stopped" and r.json()["next_at"] is None
    due()
    for e in (tight, roomy, share):
        x = get(e)
        assert x["state"] == "running" and x["rounds"] == 1 and len(x["injections"]) == 1
        assert x["gpus_touched"] == 1 and x["next_at"] is not None
    assert get(later)["rounds"] == 0
    due()
    x = get(roomy)
    assert x["rounds"] == 2 and x["gpus_touched"] == 2 and x["next_at"] is None
    assert len(x["injections"]) == 2 and x["state"] == "running"
    # The second round would pass the radius of the first: the experiment aborts instead.
    for e in (tight, share):
        x = get(e)
        assert x["state"] == "aborted" and x["rounds"] == 1
        assert "round 2" in x["abort_reason"] and "earlier rounds: 1" in x["abort_reason"]
