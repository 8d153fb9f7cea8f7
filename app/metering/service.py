"""Metering: ingest allocation lifecycle events into the ledger (idempotently, in any order),
and read usage back as integer quantities per time bucket and dimension.

Exactness: times count in whole milliseconds since the Unix epoch (floored), quantities in
milli-GPU-milliseconds, so an interval's usage is `gpu_milli * (stop_ms - start_ms)` with no
rounding anywhere, and the sum over buckets equals the sum over intervals.
"""

from __future__ import annotations

import uuid
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, and_, cast, extract, func, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, aliased

from app.core.db import as_aware, utcnow
from app.core.errors import ValidationFailed
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.metering import UsageEvent, UsageKind
from app.models.tenants import Tenant
from app.tenancy.scoping import restrict

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)
GPU_HOUR = 1000 * 3_600_000  # milli-GPU-milliseconds in one GPU-hour
GRANULARITY_MS = {"hour": 3_600_000, "day": 86_400_000}
DIMENSIONS = ("tenant_id", "workload_id", "region", "gpu_model", "shape", "tier", "priority")
MAX_BUCKETS = 24 * 400  # per query: 400 days by the hour


def to_ms(dt: datetime) -> int:
    return (as_aware(dt) - EPOCH) // MS


def from_ms(ms: int) -> datetime:
    return EPOCH + timedelta(milliseconds=ms)


def shape_of(tier: str, mig_profile: str | None, milli: int) -> str:
    """The billed shape of an allocation: what the price book prices."""
    if tier in ("vm", "confidential-vm"):
        return "vm"
    if mig_profile:
        return f"mig-{mig_profile}"
    return "fractional" if milli < 1000 else "whole"


def visible_to(auth, tenant_id: uuid.UUID | Collection[uuid.UUID] | None = None):
    """The scope `read` applies: the caller's tenancy filter (the one helper for it), narrowed
    to one tenant (or several) when an operator or a background job asks for them. It scopes a
    select of the ledger, or of another tenant-owned model read alongside (commitments)."""

    def scope(stmt, model: Any = UsageEvent):
        stmt = restrict(auth, stmt, model)
        return stmt if tenant_id is None else restrict(tenant_id, stmt, model)

    return scope


def unknown_tenants(session: Session, tenant_ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
    """Those of `tenant_ids` no tenant has (events must name a tenant that exists)."""
    known = set(session.scalars(select(Tenant.id).where(Tenant.id.in_(tenant_ids))))
    return set(tenant_ids) - known


def start_key(allocation_id: uuid.UUID | str) -> str:
    return f"alloc:{allocation_id}:start"


def stop_key(allocation_id: uuid.UUID | str) -> str:
    return f"alloc:{allocation_id}:stop"


def ingest(session: Session, events: Iterable[dict[str, Any]]) -> int:
    """Insert events whose key is new; a key seen before is skipped, whatever it carries (the
    first write wins, and history is never edited). Returns how many were new."""
    rows = [dict(e) for e in events]
    if not rows:
        return 0
    now = utcnow()
    for r in rows:
        r.setdefault("recorded_at", now)
        r.setdefault("quantity", None)
        r.setdefault("reason", None)
        r.setdefault("allocation_id", None)
        r.setdefault("workload_id", None)
    if session.get_bind().dialect.name == "postgresql":
        return _ingest_pg(session, rows)
    table = UsageEvent.__table__
    stmt = (
        sqlite_insert(table)
        .on_conflict_do_nothing(index_elements=["event_key"])
        .returning(table.c.id)
    )
    return len(session.connection().execute(stmt, rows).all())


_COLUMNS = [c.name for c in UsageEvent.__table__.columns if c.name != "id"]
_PG_INSERT = (
    f"INSERT INTO usage_events ({', '.join(_COLUMNS)}) VALUES ({', '.join(['%s'] * len(_COLUMNS))})"
    " ON CONFLICT (event_key) DO NOTHING RETURNING id"
)


def _ingest_pg(session: Session, rows: list[dict[str, Any]]) -> int:
    """psycopg's pipelined executemany of one prepared INSERT, in the session's transaction:
    about 10x the rate of SQLAlchemy's multi-row INSERTs, whose long queries psycopg converts
    afresh every time (profiled with py-spy)."""
    cur = session.connection().connection.cursor()
    try:
        cur.executemany(_PG_INSERT, [[r[c] for c in _COLUMNS] for r in rows], returning=True)
        new = 0
        while True:
            new += len(cur.fetchall())
            if not cur.nextset():
                return new
    finally:
        cur.close()


def allocation_event(
    kind: UsageKind,
    allocation,
    *,
    region: str,
    gpu_model: str,
    priority: str,
    at: datetime,
    reason: str | None = None,
) -> dict[str, Any]:
    """The ledger event for an allocation's start or stop (the allocation row carries the rest)."""
    return {
        "event_key": (start_key if kind is UsageKind.start else stop_key)(allocation.id),
        "kind": kind.value,
        "allocation_id": allocation.id,
        "workload_id": allocation.workload_id,
        "tenant_id": allocation.tenant_id,
        "region": region,
        "gpu_model": gpu_model,
        "shape": shape_of(allocation.tier, allocation.mig_profile, allocation.milli),
        "tier": allocation.tier,
        "priority": priority,
        "gpu_milli": allocation.milli * len(allocation.gpu_indices),
        "occurred_at": at,
        "reason": reason,
    }


@dataclass(frozen=True, slots=True)
class Interval:
    start_ms: int
    stop_ms: int | None  # None: still held
    gpu_milli: int
    dims: tuple  # values of DIMENSIONS, in that order


@dataclass(frozen=True, slots=True)
class Adjustment:
    at_ms: int
    quantity: int
    dims: tuple


def picker(group_by: Sequence[str]):
    """A function from an interval's `dims` to the values of `group_by`."""
    idx = [DIMENSIONS.index(g) for g in group_by]
    return lambda dims: tuple([dims[i] for i in idx])


_DIM_COLUMNS = [getattr(UsageEvent, d) for d in DIMENSIONS]


class _Reader:
    """Plain rows of the ledger through `scope` (a callable that adds the tenancy filter to a
    select of UsageEvent): columns, not ORM objects, since a month's export reads millions."""

    def __init__(self, session: Session, scope):
        # On PostgreSQL the database hands back instants as integer milliseconds: building and
        # converting millions of datetime objects was most of a month's export.
        self.pg = session.get_bind().dialect.name == "postgresql"
        self.conv = int if self.pg else to_ms
        self.scope = scope
        session.flush()  # what the session holds is read too (Core execution does not autoflush)
        self.conn = session.connection()

    def ms(self, column):
        return cast(func.floor(extract("epoch", column) * 1000), BigInteger) if self.pg else column

    def intervals(self, stmt) -> list[Interval]:
        """Intervals from a select of `columns`."""
        conv, n = self.conv, len(DIMENSIONS)
        return [
            Interval(
                conv(row[0]),
                None if row[1] is None else conv(row[1]),
                row[2],
                tuple(row[3 : 3 + n]),
            )
            for row in self.conn.execute(self.scope(stmt))
        ]

    def columns(self, start_side, stop_side) -> list:
        """A start's instant, its stop's, its milli-GPU and dimensions (of the start's row)."""
        return [
            self.ms(start_side.occurred_at),
            self.ms(stop_side.occurred_at),
            start_side.gpu_milli,
            *[getattr(start_side, d) for d in DIMENSIONS],
        ]

    def adjustments(self, start: datetime, end: datetime) -> list[Adjustment]:
        adj = select(self.ms(UsageEvent.occurred_at), UsageEvent.quantity, *_DIM_COLUMNS).where(
            UsageEvent.kind == UsageKind.adjustment.value,
            UsageEvent.occurred_at >= start,
            UsageEvent.occurred_at < end,
        )
        return [
            Adjustment(self.conv(row[0]), row[1] or 0, tuple(row[2:]))
            for row in self.conn.execute(self.scope(adj))
        ]


def read(
    session: Session, scope, start: datetime, end: datetime
) -> tuple[list[Interval], list[Adjustment]]:
    """Every interval overlapping [start, end) and every adjustment inside it, restricted by
    `scope`."""
    r = _Reader(session, scope)
    stop = aliased(UsageEvent)
    stmt = (
        select(*r.columns(UsageEvent, stop))
        .outerjoin(
            stop,
            and_(stop.allocation_id == UsageEvent.allocation_id, stop.kind == UsageKind.stop.value),
        )
        .where(
            UsageEvent.kind == UsageKind.start.value,
            UsageEvent.occurred_at < end,
            (stop.occurred_at.is_(None)) | (stop.occurred_at > start),
        )
    )
    return r.intervals(stmt), r.adjustments(start, end)


def read_since(
    session: Session, scope, since: datetime, end: datetime
) -> tuple[list[Interval], list[Interval], list[Adjustment]]:
    """What the ledger holds from `since` to `end`, in three reads on its (tenant, instant)
    index: intervals that start in [since, end) (with their stop, if any), intervals that
    started before `since` and stop in [since, end), and adjustments in [since, end)."""
    r = _Reader(session, scope)
    other = aliased(UsageEvent)
    pair = other.allocation_id == UsageEvent.allocation_id
    started = r.intervals(
        select(*r.columns(UsageEvent, other))
        .outerjoin(other, and_(pair, other.kind == UsageKind.stop.value))
        .where(
            UsageEvent.kind == UsageKind.start.value,
            UsageEvent.occurred_at >= since,
            UsageEvent.occurred_at < end,
        ),
    )
    # Read from the stop's side (its instant is the indexed one), with the start's columns.
    stopped = r.intervals(
        select(*r.columns(other, UsageEvent))
        .join(other, and_(pair, other.kind == UsageKind.start.value))
        .where(
            UsageEvent.kind == UsageKind.stop.value,
            UsageEvent.occurred_at >= since,
            UsageEvent.occurred_at < end,
            other.occurred_at < since,
        ),
    )
    return started, stopped, r.adjustments(since, end)


def _spans(intervals: Sequence[Interval], lo: int, hi: int, now: datetime | None, pick):
    """(start, end, milli, group) of each interval clipped to [lo, hi); open ones end at now."""
    now_ms = to_ms(now or utcnow())
    for iv in intervals:
        a = max(iv.start_ms, lo)
        b = min(iv.stop_ms if iv.stop_ms is not None else max(now_ms, iv.start_ms), hi)
        if b > a:
            yield a, b, iv.gpu_milli, pick(iv.dims)


def bucketize(
    intervals: Sequence[Interval],
    adjustments: Sequence[Adjustment],
    start: datetime,
    end: datetime,
    granularity: str | int,
    group_by: Sequence[str],
    now: datetime | None = None,
) -> dict[tuple[int, tuple], int]:
    """{(bucket start ms, group values): milli-GPU-ms}. Open intervals accrue up to `now`.
    `granularity` is `hour`, `day` or a bucket length in milliseconds."""
    step = granularity if isinstance(granularity, int) else GRANULARITY_MS[granularity]
    out: dict[tuple[int, tuple], int] = defaultdict(int)
    pick = picker(group_by)
    for a, b, milli, group in _spans(intervals, to_ms(start), to_ms(end), now, pick):
        bucket = a - (a % step)
        while bucket < b:
            nxt = bucket + step
            out[(bucket, group)] += milli * (min(b, nxt) - max(a, bucket))
            bucket = nxt
    for adj in adjustments:
        group = pick(adj.dims)
        out[(adj.at_ms - adj.at_ms % step, group)] += adj.quantity
    return out


def segmentize(
    intervals: Sequence[Interval],
    adjustments: Sequence[Adjustment],
    cuts: Sequence[int],
    group_by: Sequence[str],
    now: datetime | None = None,
) -> dict[tuple[int, tuple], int]:
    """Like `bucketize`, over the irregular segments [cuts[i], cuts[i+1]) (sorted ms): e.g. days
    split where a price version takes effect. Keyed by segment start."""
    lo, hi = cuts[0], cuts[-1]
    out: dict[tuple[int, tuple], int] = defaultdict(int)
    pick = picker(group_by)
    spread(out, _spans(intervals, lo, hi, now, pick), cuts)
    for adj in adjustments:
        if lo <= adj.at_ms < hi:
            seg = cuts[bisect_right(cuts, adj.at_ms) - 1]
            out[(seg, pick(adj.dims))] += adj.quantity
    return out


def spread(out: dict[tuple[int, tuple], int], spans, cuts: Sequence[int]) -> None:
    """Add each span (start, end, milli, group), inside [cuts[0], cuts[-1]), to the segments
    [cuts[i], cuts[i+1]) it covers."""
    for a, b, milli, group in spans:
        i = bisect_right(cuts, a) - 1
        while cuts[i] < b:
            out[(cuts[i], group)] += milli * (min(b, cuts[i + 1]) - max(a, cuts[i]))
            i += 1


def check_window(start: datetime, end: datetime, granularity: str) -> None:
    if granularity not in GRANULARITY_MS:
        raise ValidationFailed(
            f"granularity must be one of {', '.join(GRANULARITY_MS)}.", code="invalid_granularity"
        )
    if as_aware(end) <= as_aware(start):
        raise ValidationFailed("`to` must be after `from`.", code="invalid_window")
    buckets = (to_ms(end) - to_ms(start)) // GRANULARITY_MS[granularity]
    if buckets > MAX_BUCKETS:
        raise ValidationFailed(
            f"The window spans {buckets} {granularity}s; at most {MAX_BUCKETS} per query.",
            code="window_too_large",
        )


def usage(
    session: Session,
    scope,
    start: datetime,
    end: datetime,
    granularity: str,
    group_by: Sequence[str],
) -> list[dict[str, Any]]:
    """Usage rows, one per bucket and group, in bucket order."""
    check_window(start, end, granularity)
    unknown = [g for g in group_by if g not in DIMENSIONS]
    if unknown:
        raise ValidationFailed(
            f"Cannot group by {', '.join(unknown)}; choose from {', '.join(DIMENSIONS)}.",
            code="invalid_group_by",
        )
    intervals, adjustments = read(session, scope, start, end)
    buckets = bucketize(intervals, adjustments, start, end, granularity, group_by)
    step = GRANULARITY_MS[granularity]
    rows = []
    for (bucket, group), q in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        rows.append(
            {
                "start": from_ms(bucket),
                "end": from_ms(bucket + step),
                "group": {
                    g: (str(v) if isinstance(v, uuid.UUID) else v)
                    for g, v in zip(group_by, group, strict=True)
                },
                "milli_gpu_ms": q,
                "gpu_hours": round(q / GPU_HOUR, 6),
            }
        )
    return rows


def utilisation(
    session: Session, scope, start: datetime, end: datetime, granularity: str
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per bucket, region and GPU model: the GPU-hours the fleet had (each GPU from its
    registration), those allocated to any tenant, and the idle rest; and the window's totals,
    from the exact quantities."""
    check_window(start, end, granularity)
    # GPUs counted by when they were registered, model and region: an import registers its
    # GPUs in one instant, so a 100,000-GPU fleet is a few hundred rows here, not 100,000
    # intervals for Python to bucket.
    fleet = session.execute(
        select(Gpu.created_at, Node.gpu_model, Region.name, func.count())
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Gpu.created_at < end)
        .group_by(Gpu.created_at, Node.gpu_model, Region.name)
    ).all()
    keys = ("region", "gpu_model")
    capacity = bucketize(
        [
            Interval(to_ms(at), None, 1000 * n, (None, None, r, m, None, None, None))
            for at, m, r, n in fleet
        ],
        [],
        start,
        end,
        granularity,
        keys,
    )
    intervals, adjustments = read(session, scope, start, end)
    used = bucketize(intervals, adjustments, start, end, granularity, keys)
    step = GRANULARITY_MS[granularity]
    rows = []
    for bucket, group in sorted(set(capacity) | set(used), key=lambda k: (k[0], k[1])):
        cap, alloc = capacity.get((bucket, group), 0), used.get((bucket, group), 0)
        rows.append(
            {
                "start": from_ms(bucket),
                "end": from_ms(bucket + step),
                "region": group[0],
                "gpu_model": group[1],
                **_split(cap, alloc),
            }
        )
    return rows, _split(sum(capacity.values()), sum(used.values()))


def _split(capacity: int, allocated: int) -> dict[str, float]:
    """Capacity, allocated and idle GPU-hours from exact milli-GPU-ms."""
    return {
        "capacity_gpu_hours": round(capacity / GPU_HOUR, 6),
        "allocated_gpu_hours": round(allocated / GPU_HOUR, 6),
        "idle_gpu_hours": round((capacity - allocated) / GPU_HOUR, 6),
        "utilisation_pct": round(100 * allocated / capacity, 3) if capacity else 0.0,
    }


def usage_report(
    session: Session,
    scope,
    start: datetime,
    end: datetime,
    granularity: str,
    group_by: Sequence[str],
) -> dict[str, Any]:
    """`usage` with its window and totals: the answer REST and GraphQL give."""
    rows = usage(session, scope, start, end, granularity, group_by)
    total = sum(r["milli_gpu_ms"] for r in rows)
    return {
        "from": start,
        "to": end,
        "granularity": granularity,
        "group_by": list(group_by),
        "rows": rows,
        "total_milli_gpu_ms": total,
        "total_gpu_hours": round(total / GPU_HOUR, 6),
    }


def utilisation_report(
    session: Session, scope, start: datetime, end: datetime, granularity: str
) -> dict[str, Any]:
    """`utilisation` with its window: the answer REST and GraphQL give."""
    rows, totals = utilisation(session, scope, start, end, granularity)
    return {"from": start, "to": end, "granularity": granularity, "rows": rows, **totals}
