"""A price before submitting: a workload's dry-run (app/workloads) with what the placement it
shows would cost at the price book's list prices, and the budget it would leave. Here, above
workloads, because prices are billing's."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from app.billing.commitments import plan_of
from app.billing.service import PriceBook, amount
from app.core.db import utcnow
from app.metering import service as metering
from app.models.billing import Budget
from app.tenancy.principal import AuthContext
from app.workloads import service as workloads
from app.workloads.budget_gate import period_of
from app.workloads.schemas import WorkloadCreate

HOUR_MS = 3_600_000


def dry_run(session: Session, auth: AuthContext, body: WorkloadCreate) -> dict[str, Any]:
    """`workloads.dry_run`, priced (REST's POST /v1/workloads:dry-run and GraphQL's dryRun)."""
    out = workloads.dry_run(session, auth, body)
    out["price"] = price(session, auth, body, out)
    return out


def price(
    session: Session, auth: AuthContext, body: WorkloadCreate, dry: dict[str, Any]
) -> dict[str, Any] | None:
    """The hourly list price of the dry-run's placement (each replica's GPU-equivalents at the
    price resolved for its model, billed shape, tier, region and plan now), the most a run
    costs (over max_runtime_s), and the tenant's budget left after that."""
    if not dry["placement"]:
        return None
    book, plan, now = PriceBook.load(session), plan_of(body.priority), utcnow()
    at = metering.to_ms(now)
    shape = metering.shape_of(dry["tier"], body.mig_profile, body.milli or 1000)
    per_hour = unpriced = 0
    currency = None
    for p in dry["placement"]:
        found = book.resolve(p["gpu_model"], shape, dry["tier"], p["region"], plan, at)
        if found is None or (currency is not None and found.currency != currency):
            unpriced += 1
            continue
        currency = found.currency
        per_hour += amount(p["gpu_milli"] * HOUR_MS, found.unit_amount)
    out: dict[str, Any] = {
        "currency": currency,
        "plan": plan.value,
        "per_hour": per_hour,
        "max_cost": per_hour * body.max_runtime_s // 3600,
        "unpriced_replicas": unpriced,
    }
    budget = session.get(Budget, auth.tenant_id) if auth.tenant_id else None
    if budget is not None and budget.spend_limit is not None and budget.currency == currency:
        spent = budget.spent if budget.period == period_of(now) else 0
        left = budget.spend_limit - spent
        out["budget_left"] = left - out["max_cost"]
        out["budget_hours"] = round(left / per_hour, 2) if per_hour else None
    return out
