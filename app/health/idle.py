"""Why GPUs stand idle, hour by hour: what the health sweep records of every GPU with nothing on
it, and the report operators read (REST `GET /v1/admin/idle-time`, GraphQL `idleTime`, the
portal's chart beside the heatmap)."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware
from app.health.states import Health as H
from app.metering.service import check_window
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import IdleTime
from app.models.workloads import GpuUsage, MigClaim, Workload
from app.scheduling.lifecycle import State

CAUSES = ("no_demand", "stranded", "unhealthy", "cordoned")
AVAILABLE = ("no_demand", "stranded")  # idle with nothing wrong: placement could use them now
_USABLE = [H.healthy.value, H.suspect.value]


def _hour(at: datetime) -> datetime:
    return as_aware(at).replace(minute=0, second=0, microsecond=0)


def idle_now(session: Session) -> dict[tuple[str, str, str], int]:
    """GPUs with nothing on them now, by (region, model, cause). A GPU is busy if any share
    or MIG slice of it is held; retired nodes are out of the fleet."""
    mig = (
        select(MigClaim.node_id, MigClaim.gpu_index)
        .where(MigClaim.released_at.is_(None))
        .group_by(MigClaim.node_id, MigClaim.gpu_index)
        .subquery()
    )
    state = case(
        (or_(func.coalesce(GpuUsage.milli_used, 0) > 0, mig.c.node_id.is_not(None)), "busy"),
        (or_(Gpu.health.not_in(_USABLE), Node.health.not_in(_USABLE)), "unhealthy"),
        (Node.state != "ready", "cordoned"),
        else_="idle",
    )
    rows = session.execute(
        select(Region.name, Gpu.model, state, func.count())
        .select_from(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .outerjoin(GpuUsage, and_(GpuUsage.node_id == Gpu.node_id, GpuUsage.gpu_index == Gpu.index))
        .outerjoin(mig, and_(mig.c.node_id == Gpu.node_id, mig.c.gpu_index == Gpu.index))
        .where(Node.state != "retired")
        .group_by(Region.name, Gpu.model, state)
    ).all()
    # What waits: (region or None for any, models or None for any) of queued work.
    waiting = {
        (region, shape.gpu_models or None)
        for region, shape in session.execute(
            select(Workload.region, Workload.shape).where(
                Workload.state == State.queued.value, Workload.hold.is_(None)
            )
        )
    }

    def wanted(region: str, model: str) -> bool:
        return any(
            (r is None or r == region) and (models is None or model in models)
            for r, models in waiting
        )

    out: dict[tuple[str, str, str], int] = {}
    for region, model, st, n in rows:
        if st == "busy":
            continue
        cause = st if st != "idle" else ("stranded" if wanted(region, model) else "no_demand")
        out[(region, model, cause)] = n
    return out


def record(
    session: Session, now: datetime, idle: dict[tuple[str, str, str], int] | None = None
) -> int:
    """Add to this hour's rows the GPU-seconds since each (region, model, cause) was last
    recorded, this hour or the one before (at most two sweep periods: a stopped beat does not
    turn into a burst of idle time; a cause seen for the first time starts its clock).
    Returns the GPUs idle now."""
    idle = idle_now(session) if idle is None else idle
    cap = 2 * get_settings().health_sweep_seconds
    bucket = _hour(now)
    last: dict[tuple[str, str, str], datetime] = {}
    current: dict[tuple[str, str, str], IdleTime] = {}
    for r in session.scalars(
        select(IdleTime)
        .where(IdleTime.bucket.in_([bucket - timedelta(hours=1), bucket]))
        .with_for_update()
    ):
        key = (r.region, r.gpu_model, r.cause)
        last[key] = max(last.get(key, as_aware(r.updated_at)), as_aware(r.updated_at))
        if as_aware(r.bucket) == bucket:
            current[key] = r
    for key, n in idle.items():
        seen = last.get(key)
        dt = 0.0 if seen is None else min(cap, max(0.0, (now - seen).total_seconds()))
        row = current.get(key)
        if row is None:
            row = IdleTime(
                bucket=bucket, region=key[0], gpu_model=key[1], cause=key[2], gpu_seconds=0.0
            )
            session.add(row)
        row.gpu_seconds += n * dt
        row.updated_at = now
    return sum(idle.values())


def report(session: Session, start: datetime, end: datetime, granularity: str) -> dict[str, Any]:
    """Idle GPU-hours per bucket, region, model and cause in [start, end)."""
    check_window(start, end, granularity)
    start, end = as_aware(start), as_aware(end)
    step = timedelta(hours=1) if granularity == "hour" else timedelta(days=1)
    sums: dict[tuple[datetime, str, str, str], float] = defaultdict(float)
    for r in session.scalars(
        select(IdleTime).where(IdleTime.bucket >= _hour(start), IdleTime.bucket < end)
    ):
        at = as_aware(r.bucket)
        if at < start and granularity == "hour":
            continue
        b = at if granularity == "hour" else at.replace(hour=0)
        sums[(b, r.region, r.gpu_model, r.cause)] += r.gpu_seconds
    rows = [
        {
            "start": b,
            "end": b + step,
            "region": region,
            "gpu_model": model,
            "cause": cause,
            "gpu_hours": round(sec / 3600, 6),
        }
        for (b, region, model, cause), sec in sorted(sums.items())
    ]
    totals = {c: 0.0 for c in CAUSES}
    for r in rows:
        totals[r["cause"]] += r["gpu_hours"]
    return {
        "from": start,
        "to": end,
        "granularity": granularity,
        "rows": rows,
        "totals": [{"cause": c, "gpu_hours": round(v, 6)} for c, v in totals.items()],
    }
