"""The usage ledger on PostgreSQL: idempotent and order-independent ingestion, exact integer
totals that equal the allocations' durations, tenant isolation, append-only history."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from app.core.db import session_scope
from tests.fixtures.workloads import ALL, fleet, running
from tests.fixtures.world import SMALL_FLEET, auth, wait_until

DAY = datetime(2026, 11, 2, tzinfo=UTC)


def _script(tenant_id, prefix: str, seed: int = 3) -> list[dict]:
    """A day of allocations: whole GPUs, MIG slices, fractional shares and VMs starting and
    stopping at millisecond times (some across midnight, some still running), plus
    corrections."""
    rng = random.Random(seed)
    shapes = [("whole", 8000), ("whole", 1000), ("mig-1g", 142), ("fractional", 300), ("vm", 4000)]
    events = []
    for i in range(60):
        alloc = uuid.uuid5(uuid.NAMESPACE_URL, f"{prefix}{i}")
        shape, milli = rng.choice(shapes)
        start = DAY + timedelta(milliseconds=rng.randrange(0, 86_400_000))
        base = {
            "allocation_id": str(alloc),
            "workload_id": str(uuid.uuid5(alloc, "w")),
            "tenant_id": str(tenant_id),
            "region": rng.choice(["r1", "r2"]),
            "gpu_model": "H100-80GB",
            "shape": shape,
            "tier": "vm" if shape == "vm" else "dedicated-gpu",
            "priority": rng.choice(["production", "preemptible"]),
            "gpu_milli": milli,
        }
        events.append(
            {
                **base,
                "event_key": f"{prefix}{i}:start",
                "kind": "start",
                "occurred_at": start.isoformat(),
            }
        )
        if i % 7:  # every seventh is still running
            stop = start + timedelta(milliseconds=rng.randrange(1, 30 * 3_600_000))
            events.append(
                {
                    **base,
                    "event_key": f"{prefix}{i}:stop",
                    "kind": "stop",
                    "occurred_at": stop.isoformat(),
                    "reason": "terminated",
                }
            )
    for j in range(5):
        events.append(
            {
                **{k: v for k, v in events[j * 2].items() if k not in ("event_key", "kind")},
                "event_key": f"{prefix}adj{j}",
                "kind": "adjustment",
                "quantity": -rng.randrange(1, 10**9),
                "reason": "credit: GPU fault",
                "occurred_at": (DAY + timedelta(hours=3 * j + 1)).isoformat(),
            }
        )
    return events


def _usage(client, key, *, admin=False, **params):
    params = {"from": DAY.isoformat(), "to": (DAY + timedelta(days=3)).isoformat(), **params}
    path = "/v1/admin/usage" if admin else "/v1/usage"
    r = client.get(path, params=params, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()


def _ingest(client, op, events):
    r = client.post("/v1/admin/usage/events", json={"events": events}, headers=auth(op))
    assert r.status_code == 200, r.text
    return r.json()


def test_replayed_three_times_shuffled_equals_one_pass_in_order(client, world):
    once, thrice = world.tenant("once"), world.tenant("thrice")
    op = world.key(None)
    ordered = _script(once.id, "a:")
    assert _ingest(client, op, ordered) == {"received": len(ordered), "new": len(ordered)}
    replay = _script(thrice.id, "b:") * 3
    random.Random(11).shuffle(replay)  # stops before their starts, repeats, in any order
    news = [_ingest(client, op, replay[i : i + 50])["new"] for i in range(0, len(replay), 50)]
    assert sum(news) == len(ordered)  # each key counted once, the repeats skipped

    now = DAY + timedelta(days=2)  # the still-running ones accrue to the window's end
    for granularity, group_by in (("hour", "region,shape,tier,priority"), ("day", "")):
        a = _usage(
            client, world.key(once), granularity=granularity, group_by=group_by, to=now.isoformat()
        )
        b = _usage(
            client,
            world.key(thrice),
            granularity=granularity,
            group_by=group_by,
            to=now.isoformat(),
        )
        assert a["rows"] == b["rows"] and a["total_milli_gpu_ms"] == b["total_milli_gpu_ms"]

    # Exact: the total is the sum over intervals (clipped at the window) plus adjustments.
    expected = 0
    by_alloc: dict[str, dict] = {}
    for e in ordered:
        by_alloc.setdefault(e.get("allocation_id"), {})[e["kind"]] = e
        if e["kind"] == "adjustment":
            expected += e["quantity"]
    for pair in by_alloc.values():
        if "start" not in pair:
            continue
        start = datetime.fromisoformat(pair["start"]["occurred_at"])
        stop = datetime.fromisoformat(pair["stop"]["occurred_at"]) if "stop" in pair else now
        ms = (min(stop, now) - start) // timedelta(milliseconds=1)
        expected += pair["start"]["gpu_milli"] * ms
    assert a["total_milli_gpu_ms"] == expected


def test_usage_is_each_tenants_own_and_operators_see_all(client, world):
    a, b = world.tenant("ta"), world.tenant("tb")
    op = world.key(None)
    _ingest(client, op, _script(a.id, "ta:", seed=1) + _script(b.id, "tb:", seed=2))
    ua = _usage(client, world.key(a), group_by="tenant_id,workload_id")
    ub = _usage(client, world.key(b), group_by="tenant_id")
    assert {r["group"]["tenant_id"] for r in ua["rows"]} == {str(a.id)}
    assert {r["group"]["tenant_id"] for r in ub["rows"]} == {str(b.id)}
    everyone = _usage(client, op, admin=True)
    assert everyone["total_milli_gpu_ms"] == ua["total_milli_gpu_ms"] + ub["total_milli_gpu_ms"]
    only_a = _usage(client, op, admin=True, tenant_id=str(a.id))
    assert only_a["total_milli_gpu_ms"] == ua["total_milli_gpu_ms"]


@pytest.mark.parametrize(
    "params, code",
    [
        ({"granularity": "week"}, None),  # the query pattern: a 422 from validation
        ({"to": DAY.isoformat()}, "invalid_window"),
        ({"group_by": "colour"}, "invalid_group_by"),
        (
            {"granularity": "hour", "to": (DAY + timedelta(days=500)).isoformat()},
            "window_too_large",
        ),
    ],
)
def test_bad_usage_queries_are_422_problems(client, world, params, code):
    key = world.key(world.tenant("q"))
    params = {"from": DAY.isoformat(), "to": (DAY + timedelta(days=1)).isoformat(), **params}
    r = client.get("/v1/usage", params=params, headers=auth(key))
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    if code:
        assert r.json()["code"] == code


def test_bad_events_are_refused_and_nothing_is_written(client, world, session):
    t = world.tenant("ev")
    op = world.key(None)
    good = _script(t.id, "g:")[0]
    bad = [
        {**good, "event_key": "x1", "kind": "adjustment"},  # no quantity
        {**good, "event_key": "x2", "quantity": 5},  # a start with a quantity
        {**good, "event_key": "x3", "allocation_id": None},  # a start without allocation
        {**good, "event_key": "x4", "occurred_at": "2026-11-02T10:00:00"},  # no offset
        {**good, "event_key": "x5", "gpu_milli": -1},
    ]
    for event in bad:
        r = client.post("/v1/admin/usage/events", json={"events": [good, event]}, headers=auth(op))
        assert r.status_code == 422, (event, r.text)
    r = client.post(
        "/v1/admin/usage/events",
        json={"events": [good, {**good, "event_key": "x6", "tenant_id": str(uuid.uuid4())}]},
        headers=auth(op),
    )
    assert r.status_code == 422 and r.json()["code"] == "unknown_tenant"
    assert session.execute(text("SELECT count(*) FROM usage_events")).scalar() == 0


def test_the_ledger_is_append_only(client, world, session):
    t = world.tenant("ap")
    _ingest(client, world.key(None), _script(t.id, "ap:")[:2])
    for stmt in ("UPDATE usage_events SET gpu_milli = 0", "DELETE FROM usage_events"):
        with pytest.raises(DBAPIError, match="append-only"):
            session.execute(text(stmt))
        session.rollback()


def test_metered_usage_equals_the_allocations_held_through_preemption_and_resume(
    client, world, session, celery_worker_process
):
    """Real lifecycle on the worker: a preemptible instance runs, is preempted by a production
    one (checkpoint, requeue), resumes when that ends, and is terminated; a MIG slice and a
    fractional share run beside them. The ledger's total equals the sum over allocation rows of
    GPU-milli x held milliseconds, exactly, and nothing is left open."""
    world.fleet(fleet(2))
    a, b = world.tenant("ma", policy=ALL), world.tenant("mb", policy=ALL)
    ka, kb = world.key(a), world.key(b)

    def submit(key, **body):
        r = client.post("/v1/workloads", json={"kind": "instance", **body}, headers=auth(key))
        assert r.status_code == 201, r.text
        return r.json()["id"]

    low = submit(ka, gpus=8, priority="preemptible", checkpoint={"interval_s": 600})
    mig = submit(ka, mig_profile="1g")
    share = submit(kb, milli=250, gpu_memory_mib=4000)
    for key, wid in ((ka, low), (ka, mig), (kb, share)):
        running(client, key, wid)
    # The other node has a MIG slice and a share on it: only low's node can take 8 GPUs.
    high = submit(kb, gpus=8, priority="production")
    running(client, kb, high)
    client.delete(f"/v1/workloads/{high}", headers=auth(kb))
    running(client, ka, low)  # resumed
    for key, wid in ((ka, low), (ka, mig), (kb, share)):
        client.delete(f"/v1/workloads/{wid}", headers=auth(key))

    def settled():
        session.expire_all()
        open_ = session.execute(
            text("SELECT count(*) FROM allocations WHERE released_at IS NULL")
        ).scalar()
        session.commit()
        return open_ == 0

    wait_until(settled, timeout=60)
    held = session.execute(
        text(
            "SELECT a.milli * json_array_length(a.gpu_indices::json), a.created_at, a.released_at "
            "FROM allocations a"
        )
    ).all()
    ms = timedelta(milliseconds=1)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    expected = sum(m * ((stop - epoch) // ms - (start - epoch) // ms) for m, start, stop in held)
    preempted = session.execute(
        text("SELECT count(*) FROM usage_events WHERE kind = 'stop' AND reason = 'preempted'")
    ).scalar()
    assert preempted == 1 and len(held) == 5  # low ran twice
    window = {
        "from": (held[0][1] - timedelta(days=1)).isoformat(),
        "to": (datetime.now(UTC) + timedelta(days=1)).isoformat(),
    }
    op = world.key(None)
    total = _usage(client, op, admin=True, **window)["total_milli_gpu_ms"]
    assert total == expected > 0
    mine = _usage(client, ka, group_by="shape,priority", **window)
    shapes = {(r["group"]["shape"], r["group"]["priority"]) for r in mine["rows"]}
    assert ("whole", "preemptible") in shapes and ("mig-1g", "training") in shapes
    util = client.get("/v1/admin/utilisation", params=window, headers=auth(op)).json()
    assert util["allocated_gpu_hours"] == pytest.approx(expected / 3.6e9, abs=1e-5)
    assert {(r["region"], r["gpu_model"]) for r in util["rows"]} == {("r1", "H100-80GB")}
    capacity = sum(r["capacity_gpu_hours"] for r in util["rows"])
    assert 0 < util["allocated_gpu_hours"] < capacity  # 16 GPUs registered, a few held briefly
    assert util["idle_gpu_hours"] == pytest.approx(capacity - util["allocated_gpu_hours"], abs=1e-5)


def test_capacity_counts_each_gpu_from_its_registration(client, world):
    """Capacity is per GPU from the instant it was registered, exactly (GPUs are read counted
    by registration instant, model and region, not one by one)."""
    world.fleet(SMALL_FLEET)
    t0 = datetime(2026, 11, 2, 10, 0, tzinfo=UTC)
    with session_scope() as s:
        s.execute(text("UPDATE gpus SET created_at = :t"), {"t": t0})
        s.execute(
            text("UPDATE gpus SET created_at = :t WHERE index < 4"),
            {"t": t0 + timedelta(hours=2, minutes=30)},
        )
        total = s.execute(text("SELECT count(*) FROM gpus")).scalar_one()
        late = s.execute(text("SELECT count(*) FROM gpus WHERE index < 4")).scalar_one()
    window = {
        "from": (t0 - timedelta(hours=1)).isoformat(),
        "to": (t0 + timedelta(hours=4)).isoformat(),
        "granularity": "hour",
    }
    util = client.get("/v1/admin/utilisation", params=window, headers=auth(world.key(None))).json()
    by_hour: dict[str, float] = {}
    for r in util["rows"]:
        by_hour[r["start"]] = by_hour.get(r["start"], 0) + r["capacity_gpu_hours"]
    early = total - late
    assert [by_hour.get(h) for h in sorted(by_hour)] == [
        early,  # 10:00-11:00
        early,  # 11:00-12:00
        early + late / 2,  # 12:00-13:00: the late GPUs from 12:30
        total,  # 13:00-14:00
    ]
    assert util["capacity_gpu_hours"] == early * 4 + late * 1.5
