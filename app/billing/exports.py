"""Finance exports: one row per day, tenant, SKU, tier, region, plan and price version.

Quantities are the ledger's exact integers (their sum is the ledger's total for the period).
Amounts are allocated from each month line of the bill (the same rounding the bill makes, once
per line) to its days by largest remainder, so the rows of a line add up to the bill's amount
to the cent, and the export's total is the bills' total.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from app.billing.service import DAY_MS, amount, period_window, priced_segments
from app.core.db import utcnow
from app.metering import service as metering
from app.models.billing import Plan
from app.models.tenants import Tenant
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import scoped_select

COLUMNS = (
    "day",
    "tenant_id",
    "tenant_slug",
    "sku",
    "gpu_model",
    "shape",
    "tier",
    "region",
    "plan",
    "quantity_milli_gpu_ms",
    "gpu_hours",
    "currency",
    "unit_amount",
    "price_version",
    "amount",
)
FORMATS = ("csv", "jsonl")


def export_rows(
    session: Session, auth: AuthContext, period: str, now: datetime | None = None
) -> list[dict[str, Any]]:
    """The period's rows visible to `auth` (a tenant: its own; an operator: every tenant)."""
    start, end = period_window(period)
    book, segments = priced_segments(
        session, metering.visible_to(auth), start, end, now or utcnow()
    )

    # (line key) -> {day: quantity}; a line is what the bill prices as one amount.
    lines: dict[tuple, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    prices: dict[tuple, Any] = {}
    for (seg, (tenant, model, shape, tier, region, plan)), q in segments.items():
        price = book.resolve(model, shape, tier, region, Plan(plan), seg)
        key = (str(tenant), model, shape, tier, region, plan, price.id if price else None)
        prices[key] = price
        lines[key][seg - seg % DAY_MS] += q
    slugs = {str(t.id): t.slug for t in session.scalars(scoped_select(auth, Tenant))}
    rows = []
    for key, days in lines.items():
        tenant, model, shape, tier, region, plan_name, _ = key
        price = prices[key]
        amounts = _allocate(days, price.unit_amount if price else 0)
        for day, q in days.items():
            rows.append(
                {
                    "day": metering.from_ms(day).date().isoformat(),
                    "tenant_id": tenant,
                    "tenant_slug": slugs.get(tenant),
                    "sku": f"{model}/{shape}",
                    "gpu_model": model,
                    "shape": shape,
                    "tier": tier,
                    "region": region,
                    "plan": plan_name,
                    "quantity_milli_gpu_ms": q,
                    "gpu_hours": round(q / metering.GPU_HOUR, 6),
                    "currency": price.currency if price else None,
                    "unit_amount": price.unit_amount if price else None,
                    "price_version": price.version if price else None,
                    "amount": amounts[day],
                }
            )
    rows.sort(key=_order)
    return rows


def _order(r: dict[str, Any]) -> tuple:
    """Day, tenant, SKU, tier, region, plan, price version (comparable values, no None)."""
    return (
        r["day"],
        r["tenant_id"],
        r["gpu_model"],
        r["shape"],
        r["tier"],
        r["region"],
        r["plan"],
        r["price_version"] or 0,
    )


def _allocate(days: dict[int, int], unit_amount: int) -> dict[int, int]:
    """Split the line's amount (rounded once, as on the bill) over its days in proportion to
    their quantities, by largest remainder: integers that add up to the line's amount."""
    total = amount(sum(days.values()), unit_amount)
    qty = sum(days.values())
    if qty == 0 or total == 0:
        return {d: 0 for d in days}
    shares = {d: divmod(q * total, qty) for d, q in days.items()}
    out = {d: s[0] for d, s in shares.items()}
    # Each share is floored, so 0 <= left < len(days): one more unit to the largest remainders.
    left = total - sum(out.values())
    for d in sorted(days, key=lambda d: (-abs(shares[d][1]), d))[:left]:
        out[d] += 1
    return out


def stream(rows: list[dict[str, Any]], fmt: str, chunk: int = 2000) -> Iterator[str]:
    """The rows as CSV (with a header) or JSON lines, in chunks."""
    if fmt == "jsonl":
        for i in range(0, len(rows), chunk):
            yield "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows[i : i + chunk])
        return
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for i, r in enumerate(rows, 1):
        writer.writerow([r[c] for c in COLUMNS])
        if i % chunk == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()
