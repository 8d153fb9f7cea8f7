"""Which plan prices each piece of usage: on demand, reserved (under a commitment) or preemptible.

A commitment reserves `gpus_milli` GPU-equivalents of one GPU model, in one region or any, over
its term: at every instant of the term, the tenant's non-preemptible usage of that model is
covered up to that rate, by region-specific commitments first and then region '*', the usage
taken in a fixed order (shape, tier, region). Covered usage is priced `reserved`, the rest
`on_demand`; preemptible usage never draws on a commitment. The part of a commitment left unused
at any instant is still owed: a line of shape `unused-commitment`, priced at the reserved price
of a whole GPU.

Rates are piecewise constant (they change only where an allocation starts or stops or a term
begins or ends), so the split is computed exactly, in integers, span by span, and any way of
cutting time into segments (days and price versions for the bill, buckets for Stripe) sums to the
same split: the bill, the finance export and the Stripe meters agree on every GPU-second.
Ledger adjustments are point corrections, not rates: they are priced on demand (or preemptible).
"""

from __future__ import annotations

import uuid
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import Conflict, ValidationFailed
from app.metering import service as metering
from app.models.billing import Commitment, Plan
from app.models.fleet import Region
from app.tenancy.scoping import restrict, scoped_select

HOUR_MS = 3_600_000
UNUSED = "unused-commitment"
Segments = dict[tuple[int, tuple], int]


def plan_of(priority: str) -> Plan:
    """The plan of usage no commitment covers: preemptible work pays the preemptible price,
    everything else on demand."""
    return Plan.preemptible if priority == "preemptible" else Plan.on_demand


@dataclass(frozen=True)
class Term:
    id: uuid.UUID
    tenant_id: uuid.UUID
    gpu_model: str
    region: str
    milli: int
    start_ms: int
    end_ms: int


def load(session: Session, scope, start: datetime, end: datetime) -> list[Term]:
    """The commitments visible through `scope` whose term overlaps [start, end)."""
    stmt = select(
        Commitment.id,
        Commitment.tenant_id,
        Commitment.gpu_model,
        Commitment.region,
        Commitment.gpus_milli,
        Commitment.starts_at,
        Commitment.ends_at,
    ).where(Commitment.starts_at < end, Commitment.ends_at > start)
    return [
        Term(r[0], r[1], r[2], r[3], r[4], metering.to_ms(r[5]), metering.to_ms(r[6]))
        for r in session.execute(scope(stmt, Commitment))
    ]


# What a segment of usage is grouped by; the split replaces priority with the plan.
PLAIN = ("tenant_id", "gpu_model", "shape", "tier", "region", "priority")


def split(
    intervals: Sequence[metering.Interval], terms: Sequence[Term], cuts: Sequence[int], until: int
) -> Segments:
    """The non-preemptible `intervals` of tenants and models with `terms`, split into reserved
    and on-demand over the segments [cuts[i], cuts[i+1]), plus each commitment's unused part up
    to `until` (open intervals accrue to it too): {(segment start, (tenant, model, shape, tier,
    region, plan)): milli-GPU-ms}. Pure; the same input in any order gives the same split."""
    lo, hi = cuts[0], cuts[-1]
    until = min(until, hi)
    out: Segments = defaultdict(int)
    owners: dict[tuple, list[Term]] = defaultdict(list)
    for t in terms:
        owners[(t.tenant_id, t.gpu_model)].append(t)
    # Per tenant and model: (start, end, milli, (shape, tier, region)); usage draws in that order.
    usage: dict[tuple, list[tuple[int, int, int, tuple]]] = defaultdict(list)
    for iv in intervals:
        a = max(iv.start_ms, lo)
        b = min(iv.stop_ms if iv.stop_ms is not None else max(until, iv.start_ms), hi)
        if b > a:
            tenant, _, region, model, shape, tier, _ = iv.dims
            usage[(tenant, model)].append((a, b, iv.gpu_milli, (shape, tier, region)))
    reserved, on_demand = Plan.reserved.value, Plan.on_demand.value
    for owner, owned in owners.items():
        owned = sorted(owned, key=lambda t: (t.region == "*", t.start_ms, str(t.id)))
        deltas: dict[int, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
        for a, b, milli, what in usage.pop(owner, ()):
            deltas[a][what] += milli
            deltas[b][what] -= milli
        points = {lo, until, *deltas, *cuts}
        points.update(x for t in owned for x in (t.start_ms, t.end_ms))
        ordered = sorted(p for p in points if lo <= p < hi)
        rates: dict[tuple, int] = defaultdict(int)
        for i, p in enumerate(ordered):
            for what, d in deltas.get(p, {}).items():
                rates[what] += d
            span = (ordered[i + 1] if i + 1 < len(ordered) else hi) - p
            seg = cuts[bisect_right(cuts, p) - 1]
            pools = [[t, t.milli] for t in owned if t.start_ms <= p < t.end_ms]
            for what in sorted(k for k, r in rates.items() if r):
                rate, (shape, tier, region) = rates[what], what
                for pool in pools:
                    if rate and pool[1] and pool[0].region in (region, "*"):
                        take = min(rate, pool[1])
                        pool[1] -= take
                        rate -= take
                        out[(seg, (*owner, shape, tier, region, reserved))] += take * span
                if rate:
                    out[(seg, (*owner, shape, tier, region, on_demand))] += rate * span
            for t, rest in pools:
                if rest and p < until:  # owed only for the part of the term already past
                    key = (t.tenant_id, t.gpu_model, UNUSED, "*", t.region, reserved)
                    out[(seg, key)] += rest * span
    return out


def usage_by_plan(
    session: Session, scope, cuts: Sequence[int], now: datetime | None = None
) -> Segments:
    """The ledger's usage visible through `scope` over the segments [cuts[i], cuts[i+1]) (sorted
    ms), split by plan, with unused commitments accrued up to `now`."""
    now = now or utcnow()
    lo, hi = cuts[0], cuts[-1]
    start, end = metering.from_ms(lo), metering.from_ms(hi)
    intervals, adjustments = metering.read(session, scope, start, end)
    terms = load(session, scope, start, end)
    owners = {(t.tenant_id, t.gpu_model) for t in terms}
    committed, plain = [], []
    for iv in intervals:
        tenant, model, priority = iv.dims[0], iv.dims[3], iv.dims[6]
        ok = priority != "preemptible" and (tenant, model) in owners
        (committed if ok else plain).append(iv)
    out: Segments = defaultdict(int)
    plain_segments = metering.segmentize(plain, adjustments, cuts, PLAIN, now=now)
    for (seg, (*dims, priority)), q in plain_segments.items():
        out[(seg, (*dims, plan_of(priority).value))] += q
    if terms:
        for k, q in split(committed, terms, cuts, metering.to_ms(now)).items():
            out[k] += q
    return out


def check_region(session: Session, region: str) -> None:
    """A commitment names a region of the fleet, or '*' (any region)."""
    if region != "*" and session.scalar(select(Region.id).where(Region.name == region)) is None:
        raise ValidationFailed(f"No region named {region!r}.", code="unknown_region")


def create(session: Session, tenant_id: uuid.UUID, **fields: Any) -> Commitment:
    start, end = fields["starts_at"], fields["ends_at"]
    for name, at in (("starts_at", start), ("ends_at", end)):
        if at.minute or at.second or at.microsecond or metering.to_ms(at) % HOUR_MS:
            raise ValidationFailed(
                f"{name} must fall on a whole hour (UTC).", code="commitment_not_hourly"
            )
    if end <= start:
        raise ValidationFailed("ends_at must be after starts_at.", code="commitment_empty_term")
    c = Commitment(tenant_id=tenant_id, **fields)
    session.add(c)
    session.flush()
    return c


def cancel(session: Session, c: Commitment, now: datetime | None = None) -> None:
    """A commitment is a contract: it can be withdrawn only before its term begins."""
    if metering.to_ms(c.starts_at) <= metering.to_ms(now or utcnow()):
        raise Conflict(
            "The commitment's term has begun; it runs to its end.", code="commitment_started"
        )
    session.delete(c)
    session.flush()


def of_tenant(session: Session, auth: Any, tenant_id: uuid.UUID) -> dict[str, Any]:
    """A tenant's commitments, by start (scoped to what the caller may see)."""
    stmt = restrict(tenant_id, scoped_select(auth, Commitment), Commitment).order_by(
        Commitment.starts_at, Commitment.gpu_model, Commitment.id
    )
    return {"items": list(session.scalars(stmt))}
