"""The invariants an experiment's report checks over its history: what the fleet, the scheduler
and the health loop must never do, faults or not."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.chaos.targets import SHARED_TIERS
from app.core.config import get_settings
from app.core.db import as_aware
from app.health.breaker import breaker_limits
from app.health.states import Actor
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import HealthEvent
from app.models.metering import UsageEvent
from app.models.workloads import Allocation, Workload


def invariants(
    session: Session, started: datetime, events, affected: dict[uuid.UUID, datetime]
) -> dict[str, int]:
    """Each invariant's count of breaches (all zero when they held) since the experiment
    `started`, given its workloads' transitions (`events`) and the work its faults stopped
    (`affected`, with when)."""
    doubles = _double_allocations(session)
    after, inconsistent = _affected_work(session, affected)
    return {
        "double_allocations": doubles,
        "usage_after_fault": after,
        "inconsistent_workloads": inconsistent,
        "grace_cut_short": _grace_cut_short(events),
        "breaker_exceeded": _breaker_exceeded(session, started),
        "cross_tenant_sharing": _cross_tenant_sharing(session),
    }


def _double_allocations(session: Session) -> int:
    """Whole GPUs anywhere that live allocations hold more than once."""
    live: dict[tuple, int] = {}
    for node_id, gpus, milli in session.execute(
        select(Allocation.node_id, Allocation.gpu_indices, Allocation.milli).where(
            Allocation.released_at.is_(None)
        )
    ):
        for g in gpus:
            live[(node_id, g)] = live.get((node_id, g), 0) + milli
    return sum(1 for v in live.values() if v > 1000)


def _affected_work(session: Session, affected: dict[uuid.UUID, datetime]) -> tuple[int, int]:
    """Of the work the faults stopped: usage its allocations from before its fault recorded
    after it, and workloads whose state and live allocations disagree."""
    after = 0
    inconsistent = 0
    for wid, fault_at in affected.items():
        after += (
            session.scalar(
                select(func.count(UsageEvent.id)).where(
                    UsageEvent.workload_id == wid,
                    UsageEvent.kind == "stop",
                    UsageEvent.occurred_at > fault_at,
                    UsageEvent.allocation_id.in_(
                        select(Allocation.id).where(
                            Allocation.workload_id == wid, Allocation.created_at < fault_at
                        )
                    ),
                )
            )
            or 0
        )
        w = session.get(Workload, wid)
        n_live = session.scalar(
            select(func.count(Allocation.id)).where(
                Allocation.workload_id == wid, Allocation.released_at.is_(None)
            )
        )
        holding = w is not None and w.state in ("placing", "provisioning", "running")
        if holding != bool(n_live):
            inconsistent += 1
    return after, inconsistent


def _cross_tenant_sharing(session: Session) -> int:
    """GPUs time-sliced or MPS-shared by live work of more than one tenant (the isolation tiers
    forbid it; an experiment's noisy neighbour is always a neighbour of the same tenant)."""
    tenants: dict[tuple, set] = {}
    for node_id, gpus, tenant in session.execute(
        select(Allocation.node_id, Allocation.gpu_indices, Workload.tenant_id)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(Allocation.released_at.is_(None), Allocation.tier.in_(SHARED_TIERS))
    ):
        for g in gpus or ():
            tenants.setdefault((node_id, g), set()).add(tenant)
    return sum(1 for ts in tenants.values() if len(ts) > 1)


def _grace_cut_short(events) -> int:
    """Preempted work stopped before the deadline its notice gave (its grace period), by the
    scheduler: faults and exits may end it sooner, the grace period may not."""
    deadline: dict[uuid.UUID, datetime] = {}
    short = 0
    for e in sorted(events, key=lambda e: (e.workload_id, e.seq)):
        if e.to_state == "checkpointing" and (e.details or {}).get("deadline"):
            deadline[e.workload_id] = as_aware(datetime.fromisoformat(e.details["deadline"]))
        elif (
            e.from_state == "checkpointing"
            and e.to_state == "preempted"
            and e.reason.startswith("grace period over")
            and e.workload_id in deadline
        ):
            if (deadline.pop(e.workload_id) - as_aware(e.at)).total_seconds() > 1.0:
                short += 1
    return short


def _breaker_exceeded(session: Session, since: datetime) -> int:
    """Automatic take-outs since the experiment started that left more of a region's or a
    rack's GPUs out within the breaker's window than its limits allow."""
    window = get_settings().breaker_window_seconds
    rows = session.execute(
        select(HealthEvent.region, HealthEvent.rack, HealthEvent.taken_out, HealthEvent.at)
        .where(
            HealthEvent.actor == Actor.system.value,
            HealthEvent.taken_out > 0,
            HealthEvent.at >= since - timedelta(seconds=window),
        )
        .order_by(HealthEvent.at)
    ).all()
    if not rows:
        return 0
    sizes = {
        (region, rack): n
        for region, rack, n in session.execute(
            select(Region.name, Rack.name, func.count(Gpu.id))
            .join(Node, Gpu.node_id == Node.id)
            .join(Rack, Node.rack_id == Rack.id)
            .join(Region, Rack.region_id == Region.id)
            .group_by(Region.name, Rack.name)
        )
    }
    region_size: dict[str, int] = {}
    for (region, _rack), n in sizes.items():
        region_size[region] = region_size.get(region, 0) + n
    exceeded = 0
    for i, (region, rack, _n, at) in enumerate(rows):
        if as_aware(at) < since:
            continue
        lo = as_aware(at) - timedelta(seconds=window)
        recent = [r for r in rows[: i + 1] if as_aware(r[3]) > lo]
        lim_region, lim_rack = breaker_limits(
            region_size.get(region, 0), sizes.get((region, rack), 0)
        )
        if sum(r[2] for r in recent if r[0] == region) > lim_region or (
            sum(r[2] for r in recent if r[0] == region and r[1] == rack) > lim_rack
        ):
            exceeded += 1
    return exceeded
