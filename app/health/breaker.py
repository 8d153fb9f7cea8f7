"""The circuit breaker: what automatic quarantine may take out of a region or rack within its
window (`HealthEvent.taken_out` of the system's moves)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.health.states import Actor
from app.health.transitions import Where
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import HealthEvent


def breaker_limits(region_gpus: int, rack_gpus: int) -> tuple[int, int]:
    s = get_settings()
    return (
        max(s.breaker_min_gpus, int(s.breaker_region_share * region_gpus)),
        max(s.breaker_min_gpus, int(s.breaker_rack_share * rack_gpus)),
    )


def breaker_holds(session: Session, at: Where, taking: int, now: datetime) -> str | None:
    """Why taking `taking` more GPUs out automatically would pass the breaker, or None."""
    if taking <= 0:
        return None
    since = now - timedelta(seconds=get_settings().breaker_window_seconds)
    out_region, out_rack = session.execute(
        select(
            func.coalesce(func.sum(HealthEvent.taken_out), 0),
            func.coalesce(func.sum(HealthEvent.taken_out).filter(HealthEvent.rack == at.rack), 0),
        ).where(
            HealthEvent.region == at.region,
            HealthEvent.actor == Actor.system.value,
            HealthEvent.at >= since,
        )
    ).one()
    region_gpus, rack_gpus = session.execute(
        select(
            func.count(Gpu.id),
            func.count(Gpu.id).filter(Rack.name == at.rack),
        )
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == at.region)
    ).one()
    lim_region, lim_rack = breaker_limits(int(region_gpus), int(rack_gpus))
    window = int(get_settings().breaker_window_seconds)
    if int(out_region) + taking > lim_region:
        return (
            f"circuit breaker: {int(out_region)} of {region_gpus} GPUs of region {at.region} "
            f"already taken out automatically in the last {window} s (limit {lim_region})"
        )
    if int(out_rack) + taking > lim_rack:
        return (
            f"circuit breaker: {int(out_rack)} of {rack_gpus} GPUs of rack {at.rack} already "
            f"taken out automatically in the last {window} s (limit {lim_rack})"
        )
    return None
