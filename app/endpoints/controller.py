"""The endpoints' autoscaler (issue 47 §3): each tick, per region under its lock, read what the
gateways saw of each endpoint, decide its target with `Kpa`, record a change as an event with
its inputs, and bring its replicas to the target (`service.reconcile`, which also replaces a
replica whose run ended). Pure decisions in app/endpoints/autoscale.py; this is their edge."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware
from app.endpoints import service
from app.endpoints.autoscale import Bounds, Kpa, Sample
from app.models.endpoints import Endpoint, EndpointSample
from app.scheduling.cycle import lock_region

# Samples are kept a little past the longest window.
KEEP_SAMPLES = timedelta(minutes=10)


@dataclass(frozen=True)
class TickReport:
    endpoints: int = 0
    scaled: int = 0
    submitted: int = 0
    terminated: int = 0


def samples_of(session: Session, endpoint_ids: list, since: datetime) -> dict[object, list[Sample]]:
    """Each endpoint's samples since `since`, a second each: the gateways' in flight and
    arrivals summed, the worst p95."""
    rows = session.execute(
        select(
            EndpointSample.endpoint_id,
            EndpointSample.at,
            func.sum(EndpointSample.in_flight),
            func.sum(EndpointSample.arrivals),
            func.max(EndpointSample.p95_ms),
        )
        .where(EndpointSample.endpoint_id.in_(endpoint_ids), EndpointSample.at > since)
        .group_by(EndpointSample.endpoint_id, EndpointSample.at)
        .order_by(EndpointSample.at)
    )
    out: dict[object, list[Sample]] = defaultdict(list)
    for eid, at, in_flight, arrivals, p95 in rows:
        out[eid].append(Sample(as_aware(at).timestamp(), float(in_flight), float(arrivals), p95))
    return out


def scaler(ep: Endpoint) -> Kpa:
    """The endpoint's autoscaler, with what it remembered from the last tick."""
    s = get_settings()
    return Kpa(
        Bounds(ep.min_replicas, ep.max_replicas),
        ep.signal_target,
        ep.slo_ms,
        stable_window_s=s.endpoint_stable_window_s,
        panic_window_s=s.endpoint_panic_window_s,
        scale_down_delay_s=s.endpoint_scale_down_delay_s,
        metric="concurrency" if ep.signal == "concurrency" else "rps",
    ).recall(ep.scaler_memory or {})


def tick(session: Session, region: str | None, now: datetime) -> TickReport:
    """One decision for every endpoint of `region` (None: those without one), in the caller's
    transaction; nothing when another controller holds the region."""
    if not lock_region(session, f"endpoints/{region or ''}"):
        return TickReport()
    eps = list(
        session.scalars(
            select(Endpoint)
            .where(Endpoint.region.is_(None) if region is None else Endpoint.region == region)
            .order_by(Endpoint.id)
            .with_for_update()
        )
    )
    if not eps:
        return TickReport()
    window = max(get_settings().endpoint_stable_window_s, get_settings().endpoint_panic_window_s)
    samples = samples_of(session, [e.id for e in eps], now - timedelta(seconds=window))
    scaled = submitted = terminated = 0
    for ep in eps:
        kpa = scaler(ep)
        decision = kpa.decide(now.timestamp(), samples.get(ep.id, []), ep.target)
        if kpa.memory != (ep.scaler_memory or {}):  # an endpoint at rest writes nothing
            ep.scaler_memory = kpa.memory
        scaled += service.set_target(session, ep, decision, now)
        made, gone = service.reconcile(session, None, ep)
        submitted, terminated = submitted + made, terminated + gone
    session.execute(delete(EndpointSample).where(EndpointSample.at < now - KEEP_SAMPLES))
    return TickReport(len(eps), scaled, submitted, terminated)


def regions(session: Session) -> list[str | None]:
    return list(session.scalars(select(Endpoint.region).distinct()))
