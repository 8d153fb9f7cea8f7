"""Telemetry in (real PostgreSQL): dcgm-exporter text as it is and JSON batches; unknown GPUs
reported per sample; malformed batches refused whole, naming the sample; heartbeats; only new
faults raise signals (a gauge still showing an old Xid is not a new one)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from tests.fixtures.health import evaluations, exporter_text, push
from tests.fixtures.workloads import fleet
from tests.fixtures.world import auth

FLEET = fleet(2)  # h1, h2: HGX H100 x8


def test_exporter_text_is_taken_in_with_unknown_gpus_listed_per_sample(client, world, session):
    world.fleet(FLEET)
    op = world.key(None)
    body = (
        exporter_text(
            "h1", {"DCGM_FI_DEV_GPU_TEMP": {0: 41, 1: 43, 9: 40}, "DCGM_FI_DEV_XID_ERRORS": {0: 0}}
        )
        + exporter_text("ghost", {"DCGM_FI_DEV_GPU_TEMP": {0: 50}})
        + ('DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{gpu="0",Hostname="h1"} 0.5\n')
    )
    r = push(client, op, body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["accepted"] == 3 and got["ignored"] == 1 and got["nodes"] == 1
    assert got["unknown_count"] == 2
    problems = {(p["node"], p["gpu"], p["problem"]) for p in got["unknown"]}
    assert problems == {("h1", "9", "unknown_gpu"), ("ghost", "0", "unknown_node")}
    assert all(isinstance(p["sample"], int) for p in got["unknown"])  # the line
    # A heartbeat for h1; the learned UUIDs; no signal (Xid 0 is none).
    session.rollback()
    beats = session.execute(
        text("SELECT n.name FROM node_heartbeats b JOIN nodes n ON n.id = b.node_id")
    ).all()
    assert beats == [("h1",)]
    uuids = dict(
        session.execute(
            text(
                "SELECT g.index, g.uuid FROM gpus g JOIN nodes n ON n.id = g.node_id "
                "WHERE n.name = 'h1' AND g.uuid IS NOT NULL"
            )
        ).all()
    )
    assert uuids == {0: "GPU-h1-0000-aaaa", 1: "GPU-h1-0001-aaaa"}
    assert evaluations(session) == []


def test_a_malformed_batch_is_refused_whole_naming_the_sample(client, world, session):
    world.fleet(FLEET)
    op = world.key(None)
    good = exporter_text("h1", {"DCGM_FI_DEV_XID_ERRORS": {0: 79}})
    bad = good + 'DCGM_FI_DEV_GPU_TEMP{gpu="1",Hostname="h1"} warm\n'
    r = push(client, op, bad)
    assert r.status_code == 422
    problem = r.json()
    assert problem["code"] == "malformed_sample" and problem["line"] == 4
    assert "warm" in problem["sample"]
    r = push(client, op, good.replace('gpu="0",', "gpu=0,"))
    assert r.status_code == 422 and r.json()["line"] == 3
    # Nothing of them was kept: no heartbeat, no signal.
    session.rollback()
    assert session.execute(text("SELECT count(*) FROM node_heartbeats")).scalar() == 0
    assert evaluations(session) == []


def test_json_batches_name_gpus_by_index_or_uuid_and_bad_samples_by_position(
    client, world, session
):
    world.fleet(FLEET)
    op = world.key(None)
    ok = {
        "samples": [
            {"node": "h2", "gpu": 3, "field": "DCGM_FI_DEV_XID_ERRORS", "value": 13},
            {"node": "h2", "gpu": 42, "field": "DCGM_FI_DEV_GPU_TEMP", "value": 40},
        ],
        "nodes": ["h1"],
    }
    r = client.post("/v1/admin/telemetry", json=ok, headers=auth(op))
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 1 and r.json()["nodes"] == 2 and r.json()["signals"] == 1
    assert r.json()["unknown"] == [
        {"sample": 1, "node": "h2", "gpu": "42", "uuid": None, "problem": "unknown_gpu"}
    ]
    [ev] = evaluations(session)
    assert [(s["gpu_index"], s["signal"], s["code"]) for s in ev["signals"]] == [(3, "xid", 13)]
    bad = {"samples": [ok["samples"][0], {**ok["samples"][0], "value": "79"}]}
    r = client.post("/v1/admin/telemetry", json=bad, headers=auth(op))
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "body.samples[1].value"
    r = client.post(
        "/v1/admin/telemetry",
        json={"samples": [{"node": "h2", "field": "DCGM_FI_DEV_XID_ERRORS", "value": 1}]},
        headers=auth(op),
    )
    assert r.status_code == 422 and "name the GPU" in r.text
    assert len(evaluations(session)) == 1  # nothing more


def test_only_new_faults_raise_signals(client, world, session):
    world.fleet(FLEET)
    op = world.key(None)
    ms = int(time.time() * 1000)
    fields = {
        "DCGM_FI_DEV_XID_ERRORS": {0: 0, 1: 0},
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": {0: 0, 1: 2},
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": {0: 100, 1: 0},
    }
    assert push(client, op, exporter_text("h1", fields, ms)).json()["signals"] == 0
    # GPU 0: Xid 48 and one more double-bit error; GPU 1: replays below the burst threshold.
    fields["DCGM_FI_DEV_XID_ERRORS"][0] = 48
    fields["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"][0] = 1
    fields["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"][1] = 5
    assert push(client, op, exporter_text("h1", fields, ms + 30_000)).json()["signals"] == 2
    # The gauge still shows Xid 48: not a new fault. Replays reach 8 within the minute: one.
    fields["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"][1] = 9
    r = push(client, op, exporter_text("h1", fields, ms + 45_000)).json()
    assert r["signals"] == 1
    # A driver reload resets the counters: a lower value is a new baseline, not a fault.
    fields["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] = {0: 0, 1: 0}
    assert push(client, op, exporter_text("h1", fields, ms + 60_000)).json()["signals"] == 0
    got = [
        (s["gpu_index"], s["signal"], s["code"]) for e in evaluations(session) for s in e["signals"]
    ]
    assert got == [(0, "xid", 48), (0, "ecc_dbe", None), (1, "pcie_replay", None)]
    # What a restart needs is in the database: the Xid seen and the counters' last values.
    session.rollback()
    row = session.execute(
        text(
            "SELECT t.last_xid, t.counters FROM gpu_telemetry t JOIN gpus g ON g.id = t.gpu_id "
            "JOIN nodes n ON n.id = g.node_id WHERE n.name = 'h1' AND g.index = 0"
        )
    ).one()
    assert row[0] == 48 and row[1]["ecc_dbe"] == 1


def test_a_restarted_process_does_not_take_the_last_xid_for_a_new_fault(client, world, session):
    from app.health import telemetry

    world.fleet(FLEET)
    op = world.key(None)
    body = exporter_text("h2", {"DCGM_FI_DEV_XID_ERRORS": {5: 79}})
    assert push(client, op, body).json()["signals"] == 1
    telemetry._STATE.clear()  # as after a restart: only the database remembers
    assert push(client, op, body).json()["signals"] == 0
    assert len(evaluations(session)) == 1


def test_telemetry_is_for_operators(client, world):
    world.fleet(FLEET)
    key = world.key(world.tenant("acme"))
    r = push(client, key, exporter_text("h1", {"DCGM_FI_DEV_XID_ERRORS": {0: 79}}))
    assert r.status_code in (403, 404)


def test_a_gpu_held_below_its_clock_under_load_gets_a_lower_score_placement_sees(
    client, world, session
):
    from app.scheduling.world import read_world

    world.fleet(FLEET)
    op = world.key(None)
    ms = int(time.time() * 1000) - 600_000
    for i in range(12):  # twelve reports under load: GPU 2 at 80 % of the H100's 1980 MHz
        fields = {
            "DCGM_FI_DEV_GPU_UTIL": {1: 95, 2: 95, 3: 10},
            "DCGM_FI_DEV_SM_CLOCK": {1: 1980, 2: 1584, 3: 300},
        }
        assert push(client, op, exporter_text("h1", fields, ms + i * 30_000)).status_code == 200
    session.rollback()
    perf = dict(
        session.execute(
            text(
                "SELECT g.index, g.perf FROM gpus g JOIN nodes n ON n.id = g.node_id "
                "WHERE n.name = 'h1' AND g.index IN (1, 2, 3)"
            )
        ).all()
    )
    assert perf[2] == pytest.approx(0.8) and perf[1] == 1.0 and perf[3] == 1.0  # idle: no verdict
    spec = next(s for s in read_world(session, "r1").specs if s.name == "h1")
    assert spec.gpu_perf[2] == pytest.approx(0.8, abs=0.01) and spec.gpu_perf[1] == 1.0
