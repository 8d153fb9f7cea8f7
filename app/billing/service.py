"""Pricing the usage ledger.

Usage is cut into days, and again at the instant a price version takes effect (the ledger's
exact integer quantities); each segment of each SKU, tier, region and plan is priced at the one
version in effect over it, and segments with the same version add up into one line. A line's
amount is rounded once, half up, to the minor unit: quantities stay exact, and money is never a
float.
"""

from __future__ import annotations

import re
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.billing import commitments
from app.core.db import utcnow
from app.core.errors import ValidationFailed
from app.core.schemas import PERIOD_PATTERN
from app.metering import service as metering
from app.models.billing import Plan, Price


def amount(quantity: int, unit_amount: int) -> int:
    """Minor units for `quantity` milli-GPU-ms at `unit_amount` per GPU-hour, rounded half
    away from zero, in integers only."""
    num = abs(quantity) * unit_amount
    out = (2 * num + metering.GPU_HOUR) // (2 * metering.GPU_HOUR)
    return out if quantity >= 0 else -out


def period_window(period: str) -> tuple[datetime, datetime]:
    """`YYYY-MM` as [first instant, first instant of the next month) in UTC."""
    if not re.fullmatch(PERIOD_PATTERN, period):
        raise ValidationFailed(
            "period must be a month from 1970-01 to 2999-12, like 2026-11.", code="invalid_period"
        )
    y, mo = int(period[:4]), int(period[5:7])
    start = datetime(y, mo, 1, tzinfo=UTC)
    end = datetime(y + mo // 12, mo % 12 + 1, 1, tzinfo=UTC)
    return start, end


def create_price(session: Session, **fields: Any) -> Price:
    """A new version of the price for (model, shape, tier, region, plan)."""
    key = {k: fields[k] for k in ("gpu_model", "shape", "tier", "region", "plan")}
    last = session.scalar(
        select(func.max(Price.version)).where(*(getattr(Price, k) == v for k, v in key.items()))
    )
    price = Price(**fields, version=(last or 0) + 1)
    session.add(price)
    session.flush()
    return price


class PriceBook:
    """Every price, indexed for lookup by (model, plan); small enough to hold per request."""

    def __init__(self, prices: Sequence[Price]):
        self.by: dict[tuple[str, str], list[tuple[int, Price]]] = defaultdict(list)
        for p in prices:
            self.by[(p.gpu_model, p.plan)].append((metering.to_ms(p.effective_from), p))
        self._cache: dict[tuple, Price | None] = {}

    @classmethod
    def load(cls, session: Session) -> PriceBook:
        return cls(list(session.scalars(select(Price))))

    def resolve(
        self, gpu_model: str, shape: str, tier: str, region: str, plan: Plan, at_ms: int
    ) -> Price | None:
        """The most specific price in effect at `at_ms`: an exact shape beats its family
        (`mig` for `mig-1g`), a named tier or region beats '*'; among equals the latest
        effective date, then the highest version."""
        key = (gpu_model, shape, tier, region, plan, at_ms)
        if key in self._cache:
            return self._cache[key]
        if shape == commitments.UNUSED:  # an unused commitment owes the whole-GPU price
            shape, tier = "whole", "*"
        family = shape.split("-", 1)[0]
        best, best_rank = None, None
        for since, p in self.by.get((gpu_model, plan.value), ()):
            if since > at_ms or p.shape not in (shape, family):
                continue
            if p.tier not in (tier, "*") or p.region not in (region, "*"):
                continue
            rank = (p.shape == shape, p.tier != "*", p.region != "*", since, p.version)
            if best_rank is None or rank > best_rank:
                best, best_rank = p, rank
        self._cache[key] = best
        return best


@dataclass
class Line:
    tenant_id: str
    gpu_model: str
    shape: str
    tier: str
    region: str
    plan: str
    price: Price | None
    quantity: int = 0  # milli-GPU-ms

    @property
    def amount(self) -> int:
        return amount(self.quantity, self.price.unit_amount) if self.price else 0


@dataclass
class Priced:
    lines: list[Line] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for ln in self.lines:
            if ln.price is not None:
                out[ln.price.currency] += ln.amount
        return dict(out)

    @property
    def unpriced(self) -> int:
        return sum(ln.quantity for ln in self.lines if ln.price is None)


DAY_MS = 86_400_000


def priced_segments(
    session: Session,
    scope,
    start: datetime,
    end: datetime,
    now: datetime | None = None,
    tenant_id: uuid.UUID | None = None,
) -> tuple[PriceBook, commitments.Segments]:
    """The usage in [start, end) visible through `scope`, cut into days and again wherever a
    price version takes effect, so one price holds over each segment, and split by plan (see
    commitments): {(segment start ms, (tenant, model, shape, tier, region, plan)): milli-GPU-ms}."""
    book = PriceBook.load(session)
    lo, hi = metering.to_ms(start), metering.to_ms(end)
    cuts = {*range(lo, hi, DAY_MS), hi}
    for versions in book.by.values():
        cuts.update(since for since, _ in versions if lo < since < hi)
    if tenant_id is not None and now is not None:  # one tenant's bill, read again and again
        from app.billing import live

        segments = live.usage_by_plan(session, scope, tenant_id, sorted(cuts), metering.to_ms(now))
    else:
        segments = commitments.usage_by_plan(session, scope, sorted(cuts), now=now)
    return book, segments


def price_usage(
    session: Session,
    scope,
    start: datetime,
    end: datetime,
    *,
    now: datetime | None = None,
    tenant_id: uuid.UUID | None = None,
) -> Priced:
    """Priced lines for the usage in [start, end) visible through `scope`: one per tenant,
    SKU, tier, region, plan and price version. With `tenant_id` (a scope of that one tenant),
    from the month's kept segments (app/billing/live.py): the same lines, read faster."""
    book, segments = priced_segments(session, scope, start, end, now, tenant_id)
    lines: dict[tuple, Line] = {}
    for (seg, (tenant, model, shape, tier, region, plan)), q in segments.items():
        price = book.resolve(model, shape, tier, region, Plan(plan), seg)
        dims = (str(tenant), model, shape, tier, region, plan)
        key = (*dims, price.id if price else None)
        line = lines.get(key)
        if line is None:
            line = lines[key] = Line(*dims, price)
        line.quantity += q
    ordered = sorted(
        lines.values(),
        key=lambda ln: (
            ln.tenant_id,
            ln.gpu_model,
            ln.shape,
            ln.tier,
            ln.region,
            ln.plan,
            ln.price.version if ln.price else 0,
        ),
    )
    return Priced(ordered)


def line_out(ln: Line) -> dict[str, Any]:
    return {
        "tenant_id": uuid.UUID(ln.tenant_id),
        "sku": f"{ln.gpu_model}/{ln.shape}",
        "gpu_model": ln.gpu_model,
        "shape": ln.shape,
        "tier": ln.tier,
        "region": ln.region,
        "plan": ln.plan,
        "milli_gpu_ms": ln.quantity,
        "gpu_hours": round(ln.quantity / metering.GPU_HOUR, 6),
        "unit_amount": ln.price.unit_amount if ln.price else None,
        "currency": ln.price.currency if ln.price else None,
        "price_version": ln.price.version if ln.price else None,
        "amount": ln.amount,
    }


def price_book(session: Session) -> dict[str, Any]:
    """Every price version, in the book's order."""
    stmt = select(Price).order_by(
        Price.gpu_model, Price.shape, Price.tier, Price.region, Price.plan, Price.version
    )
    return {"items": list(session.scalars(stmt))}


def bill(session: Session, auth: Any, period: str, until: datetime | None = None) -> dict:
    """The caller's bill for a month (every tenant's for an operator): line items per SKU,
    tier, region, plan and price version, running work accrued up to `until` or now."""
    start, end = period_window(period)
    accrued = min(end, until or utcnow())
    priced = price_usage(
        session, metering.visible_to(auth), start, end, now=accrued, tenant_id=auth.tenant_id
    )
    return {
        "period": period,
        "start": start,
        "end": end,
        "accrued_until": accrued,
        "lines": [line_out(ln) for ln in priced.lines],
        "totals": priced.totals(),
        "unpriced_milli_gpu_ms": priced.unpriced,
    }


def upcoming_bill(session: Session, auth: Any) -> dict:
    """This month so far: the invoice preview."""
    now = utcnow()
    return bill(session, auth, f"{now:%Y-%m}", now)
