"""Budgets: a monthly spend limit and GPU-hour limit per tenant, alerts at 50/80/100 %, refusal
of new submissions at a hard limit, and (if the tenant chose so) preemptible work stopped.

The evaluator prices the month so far for every budgeted tenant at once (the same pricing the
bill uses) and stores the result on the budget; the submission path then reads one row by
primary key rather than pricing a month per request. A limit is therefore enforced within one
evaluation interval (`RACKPLANE_BUDGET_EVAL_SECONDS`), and at once when the budget is set.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.billing.commitments import UNUSED
from app.billing.service import period_window, price_usage
from app.core.db import dialect_insert, utcnow
from app.core.logging import get_logger
from app.metering.service import GPU_HOUR, visible_to
from app.models.billing import Budget, BudgetAlert
from app.models.tenants import Tenant
from app.models.workloads import Workload
from app.scheduling.lifecycle import HOLDING
from app.tenancy.principal import SYSTEM
from app.tenancy.scoping import get_owned, restrict, scoped_select
from app.workloads.budget_gate import period_of
from app.workloads.service import terminate

log = get_logger(__name__)
THRESHOLDS = (50, 80, 100)


def metrics(b: Budget) -> list[tuple[str, int, int]]:
    """(metric, used, limit) in the same integer unit, for each limit the budget sets."""
    out = []
    if b.spend_limit is not None:
        out.append(("spend", b.spent, b.spend_limit))
    if b.gpu_hour_limit is not None:
        out.append(("gpu_hours", b.used_milli_gpu_ms, b.gpu_hour_limit * GPU_HOUR))
    return out


def evaluate(
    session: Session, tenant_ids: list[uuid.UUID] | None = None, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Bring every budget (or those of `tenant_ids`) up to date for the current month: spend and
    GPU-hours so far, alerts for thresholds newly crossed, the exhausted mark, and preemptible
    work stopped where the tenant asked for it. Returns the alerts written now."""
    now = now or utcnow()
    period = period_of(now)
    stmt = select(Budget).order_by(Budget.tenant_id).with_for_update()
    if tenant_ids is not None:
        stmt = restrict(tenant_ids, stmt, Budget)
    budgets = list(session.scalars(stmt))
    if not budgets:
        return []
    start, end = period_window(period)
    priced = price_usage(
        session, visible_to(SYSTEM, [b.tenant_id for b in budgets]), start, end, now=now
    )
    spend: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    used: dict[str, int] = defaultdict(int)
    for ln in priced.lines:
        if ln.shape != UNUSED:  # owed money, but no GPU-hours were used
            used[ln.tenant_id] += ln.quantity
        if ln.price is not None:
            spend[ln.tenant_id][ln.price.currency] += ln.amount
    crossed: list[dict[str, Any]] = []
    for b in budgets:
        t = str(b.tenant_id)
        b.period, b.evaluated_at = period, now
        b.spent, b.used_milli_gpu_ms = spend[t][b.currency], used[t]
        reached = False
        for metric, u, limit in metrics(b):
            for pct in THRESHOLDS:
                if u * 100 >= pct * limit:
                    crossed.append(
                        {
                            "id": uuid.uuid4(),
                            "tenant_id": b.tenant_id,
                            "period": period,
                            "metric": metric,
                            "threshold_pct": pct,
                            "used": u,
                            "limit": limit,
                            "created_at": now,
                        }
                    )
            reached = reached or u >= limit
        b.exhausted_period = period if reached else None
        if reached and b.stop_preemptible:
            stop_preemptible(session, b.tenant_id, period)
    new = _record(session, crossed)
    for a in new:
        log.info("budget_alert", **{k: str(v) for k, v in a.items() if k != "id"})
    return new


def _record(session: Session, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Insert the alerts not written before (the unique key decides); return those."""
    if not alerts:
        return []
    stmt = (
        dialect_insert(session, BudgetAlert)
        .values(alerts)
        .on_conflict_do_nothing(index_elements=["tenant_id", "period", "metric", "threshold_pct"])
        .returning(BudgetAlert.id)
    )
    ids = {r[0] for r in session.execute(stmt)}
    return [a for a in alerts if a["id"] in ids]


def stop_preemptible(session: Session, tenant_id: uuid.UUID, period: str) -> int:
    """Terminate the tenant's preemptible workloads that hold GPUs. Returns how many."""
    rows = session.scalars(
        scoped_select(tenant_id, Workload)
        .where(
            Workload.priority == "preemptible",
            Workload.state.in_([s.value for s in HOLDING]),
        )
        .with_for_update()
    ).all()
    for w in rows:
        terminate(session, w, reason=f"budget for {period} exhausted: preemptible work stopped")
    audit.record_system(
        session,
        "workload.budget_stop",
        [(w.tenant_id, "workload", w.id, {"period": period}, {}) for w in rows],
    )
    if rows:
        log.info("budget_stopped_preemptible", tenant_id=str(tenant_id), workloads=len(rows))
    return len(rows)


def set_budget(session: Session, tenant_id: uuid.UUID, **fields: Any) -> Budget:
    """Create or replace the tenant's budget and evaluate it at once (a limit raised above the
    month's spend lifts the refusal now, one lowered below it applies now)."""
    b = session.get(Budget, tenant_id, with_for_update=True)
    if b is None:
        b = Budget(tenant_id=tenant_id, **fields)
        session.add(b)
    else:
        for k, v in fields.items():
            setattr(b, k, v)
    session.flush()
    evaluate(session, [tenant_id])
    return b


def view(session: Session, auth: Any, tenant_id: uuid.UUID) -> dict[str, Any]:
    """A tenant's budget with this month's use and alerts (NotFound without one)."""
    b = get_owned(session, auth, Budget, tenant_id, what="budget")
    period = period_of(utcnow())
    alerts = session.scalars(
        restrict(tenant_id, scoped_select(auth, BudgetAlert), BudgetAlert)
        .where(BudgetAlert.period == period)
        .order_by(BudgetAlert.created_at, BudgetAlert.metric, BudgetAlert.threshold_pct)
    )
    current = b.period == period
    return {
        "tenant_id": b.tenant_id,
        "currency": b.currency,
        "spend_limit": b.spend_limit,
        "gpu_hour_limit": b.gpu_hour_limit,
        "stop_preemptible": b.stop_preemptible,
        "period": b.period,
        "spent": b.spent if current else 0,
        "gpu_hours_used": round(b.used_milli_gpu_ms / GPU_HOUR, 6) if current else 0.0,
        "exhausted": b.exhausted_period == period,
        "evaluated_at": b.evaluated_at,
        "alerts": list(alerts),
    }


def remove(session: Session, auth: Any) -> None:
    """The caller's tenant has no budget any more (NotFound if it had none)."""
    tenant = get_owned(session, auth, Tenant, auth.tenant_id, what="tenant")
    session.delete(get_owned(session, auth, Budget, tenant.id, what="budget"))
    session.flush()
