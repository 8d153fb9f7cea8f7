"""`rackplane bench metering`: the ledger's ingestion rate on PostgreSQL and the time to produce
a month's finance export, on a scratch database that is dropped afterwards.

- Ingestion: start and stop events for many tenants through `metering.ingest` (the path the
  placement worker and POST /v1/admin/usage/events use), 1,000 per statement, committed every
  10,000; then the same events again (every one a duplicate the unique key turns away).
- Export: a month of intervals (default 1,000,000 for 10,000 tenants, start and stop events
  loaded with COPY, which is setup and not timed), then `exports.export_rows` and the CSV
  stream written to nowhere: the work behind GET /v1/admin/billing/exports.
"""

from __future__ import annotations

import io
import random
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

MONTH = "2026-10"
M0 = datetime(2026, 10, 1, tzinfo=UTC)
M1 = datetime(2026, 11, 1, tzinfo=UTC)
SHAPES = [
    ("H100-80GB", "whole", 8000, "dedicated-gpu"),
    ("H100-80GB", "whole", 1000, "dedicated-gpu"),
    ("H100-80GB", "mig-1g.10gb", 142, "shared-mig"),
    ("H100-80GB", "vm", 4000, "vm"),
    ("A100-80GB", "whole", 2000, "dedicated-gpu"),
    ("A100-80GB", "fractional", 500, "shared-fractional"),
]


class Scratch:
    """A scratch PostgreSQL database migrated to head (the lifecycle benchmark's, with no
    processes started), and an engine on it."""

    def __init__(self) -> None:
        from rackplane_bench.deploy import ScratchDeployment

        self.deployment = ScratchDeployment(workers=0)
        self.engine = sa.create_engine(self.deployment.env["DATABASE_URL"])

    def close(self) -> None:
        self.engine.dispose()
        self.deployment.close()


def _tenants(engine: sa.Engine, n: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(n)]
    now = datetime.now(UTC)
    with engine.begin() as c:
        c.execute(
            sa.text(
                "INSERT INTO tenants (id, slug, name, contact_email, status, isolation_policy,"
                " created_at) VALUES (:id, :slug, :name, :email, 'active', '[]', :at)"
            ),
            [
                {"id": t, "slug": f"t{i}", "name": f"T{i}", "email": f"t{i}@x.io", "at": now}
                for i, t in enumerate(ids)
            ],
        )
    return ids


def _event_rows(tenants: list[uuid.UUID], intervals: int, seed: int, tag: str):
    """(start, stop) event dicts of `intervals` allocations spread over the month."""
    rng = random.Random(seed)
    span = int((M1 - M0).total_seconds() * 1000)
    for i in range(intervals):
        model, shape, milli, tier = rng.choice(SHAPES)
        alloc = uuid.UUID(int=rng.getrandbits(128))
        start_ms = rng.randrange(0, span)
        dur = min(int(rng.lognormvariate(9.5, 1.2) * 1000), 7 * 86_400_000)  # median ~3.7 h
        base = {
            "allocation_id": alloc,
            "workload_id": alloc,
            "tenant_id": tenants[i % len(tenants)],
            "region": "r1" if i % 3 else "r2",
            "gpu_model": model,
            "shape": shape,
            "tier": tier,
            "priority": "preemptible" if i % 5 == 0 else "training",
            "gpu_milli": milli,
        }
        start = M0 + timedelta(milliseconds=start_ms)
        yield {**base, "event_key": f"{tag}{alloc}:start", "kind": "start", "occurred_at": start}
        yield {
            **base,
            "event_key": f"{tag}{alloc}:stop",
            "kind": "stop",
            "occurred_at": start + timedelta(milliseconds=max(dur, 1)),
        }


def bench_ingest(scratch: Scratch, events: int, tenants: list[uuid.UUID], run: int) -> dict:
    from app.metering.service import ingest

    rows = list(_event_rows(tenants, events // 2, seed=run, tag=f"i{run}:"))
    out = {}
    for label in ("new", "replay"):
        t0 = time.perf_counter()
        written = 0
        with Session(scratch.engine) as s:
            for i in range(0, len(rows), 10_000):
                written += ingest(s, rows[i : i + 10_000])
                s.commit()
        dt = time.perf_counter() - t0
        out[label] = {"seconds": dt, "written": written, "per_s": len(rows) / dt}
    assert out["new"]["written"] == len(rows) and out["replay"]["written"] == 0
    return out


def load_month(scratch: Scratch, tenants: list[uuid.UUID], intervals: int) -> None:
    """COPY a month of start and stop events into the ledger (setup, not timed)."""
    cols = (
        "event_key kind allocation_id workload_id tenant_id region gpu_model shape tier"
        " priority gpu_milli occurred_at recorded_at"
    ).split()
    now = datetime.now(UTC).isoformat()
    raw = scratch.engine.raw_connection()
    try:
        cur = raw.cursor()
        with cur.copy(f"COPY usage_events ({', '.join(cols)}) FROM STDIN") as copy:
            buf = io.StringIO()
            for n, e in enumerate(_event_rows(tenants, intervals, seed=42, tag="m:"), 1):
                buf.write(
                    "\t".join(
                        str(e[c])
                        if c not in ("occurred_at", "recorded_at")
                        else (e[c].isoformat() if c == "occurred_at" else now)
                        for c in cols
                    )
                    + "\n"
                )
                if n % 50_000 == 0:
                    copy.write(buf.getvalue())
                    buf = io.StringIO()
            copy.write(buf.getvalue())
        raw.commit()
        cur.execute("ANALYZE usage_events")
        raw.commit()
    finally:
        raw.close()
    from app.billing.service import create_price

    with Session(scratch.engine) as s:
        for model, shape, cents in (
            ("H100-80GB", "whole", 249),
            ("H100-80GB", "mig", 49),
            ("H100-80GB", "vm", 279),
            ("A100-80GB", "whole", 129),
            ("A100-80GB", "fractional", 139),
        ):
            for plan, factor in (("on_demand", 1.0), ("preemptible", 0.4)):
                create_price(
                    s,
                    gpu_model=model,
                    shape=shape,
                    tier="*",
                    region="*",
                    plan=plan,
                    currency="usd",
                    unit_amount=int(cents * factor),
                    effective_from=M0,
                )
        # A price change in the middle of a day, mid-month.
        create_price(
            s,
            gpu_model="H100-80GB",
            shape="whole",
            tier="*",
            region="*",
            plan="on_demand",
            currency="usd",
            unit_amount=239,
            effective_from=M0 + timedelta(days=14, hours=9),
        )
        s.commit()


def bench_export(scratch: Scratch) -> dict:
    from app.billing import exports
    from app.tenancy.principal import SYSTEM

    t0 = time.perf_counter()
    with Session(scratch.engine) as s:
        rows = exports.export_rows(s, SYSTEM, MONTH, now=M1)
    t_rows = time.perf_counter() - t0
    size = sum(len(chunk) for chunk in exports.stream(rows, "csv"))
    total = time.perf_counter() - t0
    return {
        "seconds": total,
        "rows_seconds": t_rows,
        "rows": len(rows),
        "csv_bytes": size,
        "quantity": sum(r["quantity_milli_gpu_ms"] for r in rows),
    }


def run(
    events: int = 200_000, tenants: int = 10_000, intervals: int = 1_000_000, runs: int = 3
) -> dict[str, Any]:
    scratch = Scratch()
    try:
        ids = _tenants(scratch.engine, tenants)
        ingest_runs = [bench_ingest(scratch, events, ids[:1000], r) for r in range(runs)]
        with scratch.engine.begin() as c:  # the export month only
            c.execute(sa.text("ALTER TABLE usage_events DISABLE TRIGGER USER"))
            c.execute(sa.text("DELETE FROM usage_events"))
            c.execute(sa.text("ALTER TABLE usage_events ENABLE TRIGGER USER"))
        load_month(scratch, ids, intervals)
        export_runs = [bench_export(scratch) for _ in range(runs)]
        with scratch.engine.connect() as c:
            ledger = c.execute(
                sa.text(
                    "SELECT coalesce(sum(s.gpu_milli::numeric * (extract(epoch FROM"
                    " least(p.occurred_at, :m1) - greatest(s.occurred_at, :m0)) * 1000)), 0)"
                    " FROM usage_events s JOIN usage_events p ON p.allocation_id ="
                    " s.allocation_id AND p.kind = 'stop' WHERE s.kind = 'start'"
                    " AND s.occurred_at < :m1"
                ),
                {"m0": M0, "m1": M1},
            ).scalar()
    finally:
        scratch.close()
    med = statistics.median
    return {
        "benchmark": "metering",
        "database": "postgresql",
        "runs": runs,
        "ingest_events": events,
        "ingest_events_per_s": round(med(r["new"]["per_s"] for r in ingest_runs)),
        "ingest_replay_events_per_s": round(med(r["replay"]["per_s"] for r in ingest_runs)),
        "export_tenants": tenants,
        "export_intervals": intervals,
        "export_rows": export_runs[0]["rows"],
        "export_csv_bytes": export_runs[0]["csv_bytes"],
        "export_seconds": round(med(r["seconds"] for r in export_runs), 2),
        "export_seconds_runs": [round(r["seconds"], 2) for r in export_runs],
        "export_equals_ledger": int(ledger) == export_runs[0]["quantity"],
    }
