"""Idle GPU-hours by cause: what the health sweep records of every idle GPU and why, and the
report operators read over REST and GraphQL (the portal's chart beside the heatmap)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from app.core.db import session_scope, utcnow
from app.health import idle
from tests.fixtures.graphql import gql
from tests.fixtures.world import SMALL_FLEET, auth


def _seed(client, world):
    world.fleet(SMALL_FLEET)  # h100-1 (GPU 7 in MIG mode), h100-2 cordoned, an NVL72 rack
    tenant = world.key(world.tenant("acme"))
    with session_scope() as s:
        s.execute(text("UPDATE gpus SET health = 'quarantined' WHERE index = 2"))  # one a node
        node = s.execute(text("SELECT id FROM nodes WHERE name = 'h100-1'")).scalar_one()
        s.execute(  # a share held on h100-1's GPU 0: busy, not idle
            text(
                "INSERT INTO gpu_usage (node_id, gpu_index, milli_used, memory_mib, "
                "memory_used_mib) VALUES (:n, 0, 500, 81920, 1000)"
            ),
            {"n": node},
        )
    # Work that waits for an H100 and cannot start, even with the suite's worker about: h100-1
    # has a quarantined GPU, h100-2 is cordoned.
    r = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 8, "gpu_models": ["H100-80GB"]},
        headers=auth(tenant),
    )
    assert r.status_code == 201, r.text


def test_each_idle_gpu_is_counted_once_under_its_cause(client, world):
    _seed(client, world)
    with session_scope() as s:
        now = idle.idle_now(s)
    by_cause: dict[str, int] = {}
    for (_region, _model, cause), n in now.items():
        by_cause[cause] = by_cause.get(cause, 0) + n
    # h100-1: GPU 0 busy, GPU 2 quarantined, 6 idle while H100 work waits: stranded.
    # h100-2: cordoned (7) and its GPU 2 quarantined. NVL72: 18 quarantined, 54 no demand.
    assert by_cause == {"stranded": 6, "cordoned": 7, "unhealthy": 1 + 1 + 18, "no_demand": 54}


def test_the_sweep_adds_time_and_rest_and_graphql_report_it_alike(client, world):
    _seed(client, world)
    # An hour of its own, long past: the suite's worker sweeps (and records) the present.
    t0 = datetime(2026, 1, 5, 10, 10, tzinfo=UTC)
    with session_scope() as s:
        idle.record(s, t0)  # the first record only starts the clock
    with session_scope() as s:
        idle.record(s, t0 + timedelta(seconds=1))
    with session_scope() as s:  # a stopped beat counts at most two sweep periods (2 x 1 s)
        idle.record(s, t0 + timedelta(seconds=301))
    window = {
        "from": (t0 - timedelta(hours=1)).isoformat(),
        "to": (t0 + timedelta(hours=1)).isoformat(),
    }
    op = world.key()
    r = client.get(
        "/v1/admin/idle-time", params={**window, "granularity": "hour"}, headers=auth(op)
    )
    assert r.status_code == 200, r.text
    body = r.json()
    totals = {t["cause"]: t["gpu_hours"] for t in body["totals"]}
    # 1 s, then 2 s (capped at two of the tests' 1 s sweep periods), of each idle GPU.
    assert totals == {
        "no_demand": round(54 * 3 / 3600, 6),
        "stranded": round(6 * 3 / 3600, 6),
        "unhealthy": round(20 * 3 / 3600, 6),
        "cordoned": round(7 * 3 / 3600, 6),
    }
    assert {row["start"][:13] for row in body["rows"]} == {t0.isoformat()[:13]}
    q = """query($from: DateTime!, $to: DateTime!) { idleTime(from: $from, to: $to) {
      totals { cause gpuHours } rows { cause gpuModel gpuHours } } }"""
    data = gql(client, op, q, **window)["data"]["idleTime"]
    assert {t["cause"]: t["gpuHours"] for t in data["totals"]} == totals
    assert len(data["rows"]) == len(body["rows"])


def test_bad_windows_are_refused_with_a_code(client, world):
    op = world.key()
    now = utcnow()
    r = client.get(
        "/v1/admin/idle-time",
        params={"from": now.isoformat(), "to": (now - timedelta(hours=1)).isoformat()},
        headers=auth(op),
    )
    assert r.status_code in (400, 422) and r.json()["code"] == "invalid_window"
    r = client.get(
        "/v1/admin/idle-time",
        params={"from": now.isoformat(), "to": now.isoformat(), "granularity": "week"},
        headers=auth(op),
    )
    assert r.status_code == 422
    tenant = world.key(world.tenant("acme"))
    r = client.get(
        "/v1/admin/idle-time",
        params={"from": now.isoformat(), "to": (now + timedelta(hours=1)).isoformat()},
        headers=auth(tenant),
    )
    assert r.status_code == 403
