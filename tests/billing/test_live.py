"""A bill from the month's kept segments plus what happened since the last whole hour
(app/billing/live.py) is the bill the full reading of the ledger gives, whatever the ledger
holds: allocations across the hour, stopped since, dated after now, adjustments, a price that
changes within the hour, events arriving late; and a kept month is not read again."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from app.billing import live
from app.billing.service import create_price, line_out, period_window, price_usage
from app.core.db import session_scope
from app.metering import service as metering
from app.metering.service import ingest, visible_to
from app.tenancy.principal import AuthContext

MONTH = "2026-11"
START, END = period_window(MONTH)


def _auth(tenant_id):
    return AuthContext(uuid.uuid4(), "test", tenant_id, frozenset({"read"}), "active")


def _events(rng: random.Random, tenant_id, n: int, lo: datetime, hi: datetime, tag: str):
    span = (hi - lo).total_seconds()
    out = []
    for i in range(n):
        alloc = uuid.uuid4()
        begin = lo + timedelta(seconds=rng.uniform(0, span))
        dims = {
            "workload_id": str(alloc),
            "tenant_id": str(tenant_id),
            "region": rng.choice(["r1", "r2"]),
            "gpu_model": "H100-80GB",
            "shape": rng.choice(["whole", "fractional"]),
            "tier": "dedicated",
            "priority": rng.choice(["training", "preemptible"]),
            "gpu_milli": rng.choice([500, 1000, 8000]),
        }
        out.append(
            {
                **dims,
                "event_key": f"{tag}{i}:start",
                "kind": "start",
                "allocation_id": str(alloc),
                "occurred_at": begin,
            }
        )
        if rng.random() < 0.6:  # stopped (some after `now`: dated in the future)
            stop = begin + timedelta(seconds=rng.uniform(1, 3 * 86_400))
            out.append(
                {
                    **dims,
                    "event_key": f"{tag}{i}:stop",
                    "kind": "stop",
                    "allocation_id": str(alloc),
                    "occurred_at": stop,
                }
            )
        if rng.random() < 0.1:
            out.append(
                {
                    **dims,
                    "event_key": f"{tag}{i}:adj",
                    "kind": "adjustment",
                    "gpu_milli": 0,
                    "quantity": rng.randint(-(10**9), 10**9),
                    "occurred_at": begin,
                }
            )
    return out


def _price(session, cents: int, since: datetime) -> None:
    create_price(
        session,
        gpu_model="H100-80GB",
        shape="whole",
        tier="*",
        region="*",
        plan="on_demand",
        currency="usd",
        unit_amount=cents,
        effective_from=since,
    )


def _lines(session, tenant_id, now, *, kept: bool):
    priced = price_usage(
        session,
        visible_to(_auth(tenant_id)),
        START,
        END,
        now=now,
        tenant_id=tenant_id if kept else None,
    )
    return sorted(
        (ln for ln in map(line_out, priced.lines) if ln["milli_gpu_ms"]),
        key=lambda ln: (ln["region"], ln["shape"], ln["plan"], ln["price_version"] or 0),
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_kept_bill_is_the_full_reading(world, seed, monkeypatch):
    rng = random.Random(seed)
    tenant = world.tenant(f"live{seed}")
    now = datetime(2026, 11, 20, 14, 37, 12, tzinfo=UTC)
    h = now.replace(minute=0, second=0)
    with session_scope() as s:
        _price(s, 250, datetime(2026, 10, 1, tzinfo=UTC))
        # A new version effective between the last whole hour and now.
        _price(s, 300, h + timedelta(minutes=20))
        # Around the month's start, before the hour, and within it.
        ingest(s, _events(rng, tenant.id, 40, START - timedelta(days=3), h, "a"))
        ingest(s, _events(rng, tenant.id, 10, h - timedelta(hours=2), now, "b"))
        # Edges: a stop exactly at the hour, a start exactly at the hour.
        edge = _events(random.Random(0), tenant.id, 2, h - timedelta(hours=1), h, "edge")
        edge = [e for e in edge if e["kind"] == "start"]
        stop = {**edge[0], "event_key": "edge-stop", "kind": "stop", "occurred_at": h}
        edge[1]["occurred_at"] = h
        ingest(s, [*edge, stop])
        # Held until the steps below stop them one by one.
        held = [
            e
            for e in _events(rng, tenant.id, 8, h - timedelta(days=1), h, "o")
            if e["kind"] == "start"
        ]
        ingest(s, held)
    live.clear()
    with session_scope() as s:
        want = _lines(s, tenant.id, now, kept=False)
        assert want and _lines(s, tenant.id, now, kept=True) == want
    # Kept: later requests, minutes apart, with work starting and stopping in between, read
    # only what happened since the kept minute; never the month.
    calls = []
    real = metering.read
    monkeypatch.setattr(metering, "read", lambda *a, **k: calls.append(1) or real(*a, **k))
    at = now
    for step in range(6):
        later = at + timedelta(seconds=rng.choice([20, 61, 97, 600, 3600]))
        kept_minute = at.replace(second=0, microsecond=0)
        with session_scope() as s:
            ingest(s, _events(rng, tenant.id, 4, kept_minute, later, f"c{step}"))
            ends = kept_minute + (later - kept_minute) * rng.random()
            ingest(
                s,
                [{**held[step], "event_key": f"o-stop{step}", "kind": "stop", "occurred_at": ends}],
            )
            got = _lines(s, tenant.id, later, kept=True)
            assert calls == [], step
            want = _lines(s, tenant.id, later, kept=False)
            calls.clear()
            assert got == want, step
        at = later
    # An event arriving late, dated before the kept minute, is seen: the month is read again.
    with session_scope() as s:
        ingest(s, _events(rng, tenant.id, 3, h - timedelta(days=2), h, "late"))
    with session_scope() as s:
        got = _lines(s, tenant.id, at, kept=True)
        assert len(calls) == 1  # the month read again, once
        assert got == _lines(s, tenant.id, at, kept=False)


def test_the_first_hour_of_a_month_and_a_month_gone_by(world):
    rng = random.Random(7)
    tenant = world.tenant("liveedge")
    with session_scope() as s:
        _price(s, 250, datetime(2026, 10, 1, tzinfo=UTC))
        ingest(
            s,
            _events(
                rng, tenant.id, 30, START - timedelta(days=2), START + timedelta(minutes=50), "e"
            ),
        )
        ingest(
            s, _events(rng, tenant.id, 10, END - timedelta(days=1), END + timedelta(days=1), "f")
        )
    live.clear()
    with session_scope() as s:
        for now in (START + timedelta(minutes=40), END + timedelta(days=3)):
            now = min(now, END)
            assert _lines(s, tenant.id, now, kept=True) == _lines(s, tenant.id, now, kept=False)


def test_what_the_horizon_proves(world, monkeypatch):
    """Kept segments are proved by the ledger's settled id horizon, not a count of the month:
    an event the caller's own transaction wrote, dated before the kept minute, answers that
    transaction's bill but is not kept (it may roll back); a start dated months before the
    month, arriving late, is seen (the month is read again)."""
    from app.core.db import get_sessionmaker

    rng = random.Random(11)
    tenant = world.tenant("livehorizon")
    now = datetime(2026, 11, 20, 14, 37, 12, tzinfo=UTC)
    with session_scope() as s:
        _price(s, 250, datetime(2026, 8, 1, tzinfo=UTC))
        ingest(s, _events(rng, tenant.id, 30, START - timedelta(days=2), now, "a"))
    live.clear()
    with session_scope() as s:
        assert _lines(s, tenant.id, now, kept=True) == _lines(s, tenant.id, now, kept=False)
    calls = []
    real = metering.read
    monkeypatch.setattr(metering, "read", lambda *a, **k: calls.append(1) or real(*a, **k))
    # Written and read in one transaction, then rolled back.
    s = get_sessionmaker()()
    try:
        ingest(
            s, _events(rng, tenant.id, 3, START + timedelta(days=1), START + timedelta(days=5), "x")
        )
        assert _lines(s, tenant.id, now, kept=True) == _lines(s, tenant.id, now, kept=False)
    finally:
        s.rollback()
        s.close()
    calls.clear()
    with session_scope() as s:
        assert _lines(s, tenant.id, now, kept=True) == _lines(s, tenant.id, now, kept=False)
        assert calls == [1]  # the full reading's only: the kept segments stood
    # A start dated long before the month, still running: late, and seen.
    old = [
        e
        for e in _events(
            rng, tenant.id, 2, START - timedelta(days=90), START - timedelta(days=80), "old"
        )
        if e["kind"] == "start"
    ]
    with session_scope() as s:
        ingest(s, old)
    calls.clear()
    with session_scope() as s:
        got = _lines(s, tenant.id, now, kept=True)
        assert calls == [1]  # the month read again
        assert got == _lines(s, tenant.id, now, kept=False)
