"""The submission's budget gate: new work is refused while the tenant's budget for this month is
spent. The budget (app/billing/budgets.py) marks the month it is exhausted for; this reads the
mark, so a submission prices nothing."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import AppError
from app.core.money import format_money
from app.metering.service import GPU_HOUR
from app.models.billing import Budget


class BudgetExhausted(AppError):
    status, code, title = 402, "budget_exhausted", "The tenant's budget for this month is spent"


def period_of(at: datetime) -> str:
    return f"{at:%Y-%m}"


def check_submission(
    session: Session,
    tenant_id: uuid.UUID,
    exhausted_period: str | None,
    now: datetime | None = None,
) -> None:
    """Refuse new work while the tenant's budget for this month is exhausted. `exhausted_period`
    is the budget's mark as read with the caller's key (kept current by the key cache's epoch,
    app/tenancy/auth.py): the budget row is read only when that mark says this month."""
    if exhausted_period != period_of(now or utcnow()):
        return
    b = session.get(Budget, tenant_id)
    if b is None or b.exhausted_period != period_of(now or utcnow()):
        return
    raise BudgetExhausted(
        f"The budget for {b.exhausted_period} is reached ({describe(b)}); new workloads are "
        "refused until the month ends or the limit is raised (PUT /v1/budget, `setBudget`, or "
        "the portal's budget page) or the budget is removed (DELETE /v1/budget).",
        period=b.exhausted_period,
        spent=b.spent,
        spend_limit=b.spend_limit,
        currency=b.currency,
        gpu_hours_used=round(b.used_milli_gpu_ms / GPU_HOUR, 6),
        gpu_hour_limit=b.gpu_hour_limit,
    )


def describe(b: Budget) -> str:
    parts = []
    if b.spend_limit is not None:
        spent, limit = format_money(b.spent, b.currency), format_money(b.spend_limit, b.currency)
        parts.append(f"{spent} spent of {limit}")
    if b.gpu_hour_limit is not None:
        parts.append(f"{b.used_milli_gpu_ms / GPU_HOUR:.3f} of {b.gpu_hour_limit} GPU-hours")
    return "; ".join(parts)
