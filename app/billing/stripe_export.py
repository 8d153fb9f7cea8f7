"""Usage to Stripe Billing meter events, through an outbox, and reconciliation.

Three steps, each safe to repeat and to crash in:

1. **plan** (one planner at a time): for every bucket (an hour by default) that ended more than
   the settle delay ago, compare the ledger's usage per tenant, meter, tier and region with what
   the outbox already holds, and write the difference: a new meter event for more usage; for
   less usage, the cancellation of the bucket's events (Stripe allows it within 24 hours; the
   next plan re-sends the right total), or after that window a credit adjustment. Buckets older
   than Stripe's 35-day timestamp window become adjustments too.
2. **send**: each outbox row is sent with its deterministic identifier, then marked. A crash
   between Stripe's answer and the mark re-sends the same identifier, which Stripe refuses as a
   duplicate, and the row is then marked. One call at a time per customer and meter (an
   advisory lock), backing off on 429.
3. **reconcile**: ledger totals against exported totals per tenant, meter and month.

Meter values are the ledger's exact unit, milli-GPU-milliseconds (integers); a Stripe price on
such a meter divides by 3.6e9 (`transform_quantity`) to bill GPU-hours.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.billing import commitments
from app.billing.service import period_window
from app.billing.stripe_gateway import RETRYABLE, AlreadyRecorded, Rejected, gateway
from app.core.config import get_settings
from app.core.db import as_aware, get_sessionmaker, utcnow
from app.core.logging import get_logger
from app.metering import service as metering
from app.models.billing import (
    BillingAdjustment,
    Commitment,
    ExportState,
    MeterExport,
    MeterExportCursor,
)
from app.models.metering import UsageEvent
from app.models.tenants import Tenant
from app.tenancy.principal import SYSTEM, AuthContext
from app.tenancy.scoping import restrict, scoped_select

log = get_logger(__name__)
DAY_MS = 86_400_000
STRIPE_PAST_MS = 34 * DAY_MS  # Stripe takes timestamps up to 35 days old; keep a day's margin
CANCEL_WINDOW = timedelta(hours=23)  # Stripe cancels events up to 24 hours old; same margin
LATE_MARGIN = timedelta(minutes=5)  # ledger rows recorded this long before the last plan recheck
_LOCK_NS = 0x5254  # advisory-lock namespace: (ns, 0) planner, (ns + 1, hash) customer and meter
FAULT_ENV = "RACKPLANE_FAULT_EXIT_AFTER_STRIPE_CALLS"


def meter_name(gpu_model: str, shape: str, plan: str) -> str:
    """The Stripe meter's event name for a SKU and plan, e.g. `gpu_h100_80gb_whole_on_demand`."""
    return re.sub(r"[^a-z0-9]+", "_", f"gpu_{gpu_model}_{shape}_{plan}".lower()).strip("_")[:100]


def identifier(tenant_id: Any, meter: str, tier: str, region: str, bucket_ms: int, seq: int) -> str:
    """Deterministic and at most 100 characters: the same planned row always gets the same one."""
    digest = hashlib.sha256(f"{tenant_id}|{meter}|{tier}|{region}|{bucket_ms}".encode()).hexdigest()
    return f"rp_{digest[:32]}_{bucket_ms // 1000}_{seq}"


def _step_ms() -> int:
    return get_settings().meter_bucket_seconds * 1000


def closed_until(now: datetime) -> int:
    """End (ms) of the last bucket that ended at least the settle delay before `now`."""
    s = get_settings()
    t = metering.to_ms(now) - int(s.meter_settle_seconds * 1000)
    return t - t % _step_ms()


def _is_pg(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _customers(session: Session, auth: AuthContext = SYSTEM) -> dict[uuid.UUID, str]:
    stmt = scoped_select(auth, Tenant).where(Tenant.stripe_customer_id.is_not(None))
    return {t.id: t.stripe_customer_id for t in session.scalars(stmt)}


Key = tuple[uuid.UUID, str, str, str, int]  # tenant, meter, tier, region, bucket start ms


def ledger_by_key(session: Session, scope, lo_ms: int, hi_ms: int, now: datetime) -> dict[Key, int]:
    """The ledger's usage per tenant, meter, tier, region and bucket in [lo, hi), split by plan
    as the bill splits it (unused commitments are not usage: the subscription bills them)."""
    step = _step_ms()
    cuts = [*range(lo_ms, hi_ms, step), hi_ms]
    segments = commitments.usage_by_plan(session, scope, cuts, now=now)
    out: dict[Key, int] = defaultdict(int)
    for (seg, (tenant, model, shape, tier, region, plan)), q in segments.items():
        if shape != commitments.UNUSED:
            out[(tenant, meter_name(model, shape, plan), tier, region, seg - seg % step)] += q
    return out


@dataclass
class PlanReport:
    window: tuple[datetime, datetime] | None = None
    events: int = 0
    cancels: int = 0
    adjustments: int = 0


def plan(session: Session, now: datetime | None = None) -> PlanReport:
    """Write the outbox rows (and adjustments) that bring Stripe in line with the ledger for
    every closed bucket the planner has not seen, or saw before a late ledger row arrived; and,
    on a full pass, for every closed bucket in Stripe's window."""
    now = now or utcnow()
    report = PlanReport()
    cursor = _claim_cursor(session)
    step = _step_ms()
    hi = closed_until(now)
    horizon = metering.to_ms(now) - STRIPE_PAST_MS
    horizon -= horizon % step
    lo = _plan_from(session, cursor, now, horizon, step)
    customers = _customers(session)
    cursor.last_run_at = now
    if lo >= hi or not customers:
        cursor.planned_through = metering.from_ms(max(hi, lo))
        return report
    report.window = (metering.from_ms(lo), metering.from_ms(hi))
    ledger = ledger_by_key(session, metering.visible_to(SYSTEM, list(customers)), lo, hi, now)
    rows, adjusted = _exported_by_key(session, report.window)
    for key in sorted(set(ledger) | set(rows) | set(adjusted), key=str):
        tenant = key[0]
        if tenant not in customers:
            continue
        owed = ledger.get(key, 0) - adjusted.get(key, 0)
        _settle(session, key, owed, rows.get(key, []), customers[tenant], horizon, now, report)
    prev = hi if cursor.planned_through is None else metering.to_ms(cursor.planned_through)
    cursor.planned_through = metering.from_ms(max(hi, prev))
    session.flush()
    return report


def _claim_cursor(session: Session) -> MeterExportCursor:
    """The planner's cursor, locked (one planner at a time), created on the first run."""
    if _is_pg(session):
        session.execute(select(func.pg_advisory_xact_lock(_LOCK_NS, 0)))
    cursor = session.get(MeterExportCursor, 1, with_for_update=True)
    if cursor is None:
        cursor = MeterExportCursor(id=1)
        session.add(cursor)
    return cursor


def _plan_from(
    session: Session, cursor: MeterExportCursor, now: datetime, horizon: int, step: int
) -> int:
    """Start (ms, on a bucket boundary) of this run's window: Stripe's horizon on a full pass
    (marked as done now); else where the last run stopped, or earlier for usage the ledger
    recorded late since then."""
    full = _full_pass_due(session, cursor, now)
    lo = horizon if full else metering.to_ms(cursor.planned_through or now)
    if full:
        cursor.full_pass_at = now
    elif cursor.last_run_at is not None:
        earliest = session.scalar(
            restrict(SYSTEM, select(func.min(UsageEvent.occurred_at)), UsageEvent).where(
                UsageEvent.recorded_at >= as_aware(cursor.last_run_at) - LATE_MARGIN
            )
        )
        if earliest is not None:
            lo = min(lo, metering.to_ms(earliest))
    lo -= lo % step
    return lo


def _full_pass_due(session: Session, cursor: MeterExportCursor, now: datetime) -> bool:
    """Whether this run rechecks every bucket in Stripe's window: none yet, the last one too
    long ago, or a commitment recorded since the last run re-prices the past."""
    full = cursor.full_pass_at is None or now - as_aware(cursor.full_pass_at) >= timedelta(
        seconds=get_settings().meter_full_pass_seconds
    )
    if not full and cursor.last_run_at is not None:
        # A commitment recorded since the last run over a term already begun re-prices the past
        # (found here rather than signalled, so recording one never waits for this lock).
        since = as_aware(cursor.last_run_at) - LATE_MARGIN
        recent = restrict(SYSTEM, select(func.count()).select_from(Commitment), Commitment)
        recent = recent.where(
            Commitment.created_at >= since, Commitment.starts_at < Commitment.created_at
        )
        full = bool(session.scalar(recent))
    return full


def _exported_by_key(
    session: Session, window: tuple[datetime, datetime]
) -> tuple[dict[Key, list[MeterExport]], dict[Key, int]]:
    """What the outbox holds per key in the window (its rows), and what adjustments cover."""
    rows: dict[Key, list[MeterExport]] = defaultdict(list)
    for r in session.scalars(
        restrict(SYSTEM, select(MeterExport), MeterExport).where(
            MeterExport.bucket_start >= window[0],
            MeterExport.bucket_start < window[1],
        )
    ):
        rows[(r.tenant_id, r.meter, r.tier, r.region, metering.to_ms(r.bucket_start))].append(r)
    adjusted: dict[Key, int] = defaultdict(int)
    for a in session.scalars(
        restrict(SYSTEM, select(BillingAdjustment), BillingAdjustment).where(
            BillingAdjustment.bucket_start >= window[0],
            BillingAdjustment.bucket_start < window[1],
        )
    ):
        adjusted[(a.tenant_id, a.meter, a.tier, a.region, metering.to_ms(a.bucket_start))] += (
            a.quantity
        )
    return rows, adjusted


def _settle(
    session: Session,
    key: Key,
    owed: int,
    mine: list[MeterExport],
    customer_id: str,
    horizon: int,
    now: datetime,
    report: PlanReport,
) -> None:
    """Bring one key's exported total to what it `owes` Stripe (the ledger's usage less the
    adjustments): a new meter event, cancellations, or an adjustment. A key with rows still
    in flight waits for them."""
    tenant, meter, tier, region, bucket = key
    if any(r.state not in (ExportState.sent.value, ExportState.cancelled.value) for r in mine):
        return  # in flight (or failed and waiting for an operator): decide after
    live = [r for r in mine if r.state == ExportState.sent.value]
    delta = owed - sum(r.value for r in live)
    if delta == 0:
        return
    if bucket < horizon:
        _adjust(session, key, delta, "bucket older than Stripe's 35-day meter window", report)
    elif delta > 0:
        seq = max((r.seq for r in mine), default=0) + 1
        session.add(
            MeterExport(
                identifier=identifier(tenant, meter, tier, region, bucket, seq),
                tenant_id=tenant,
                customer_id=customer_id,
                meter=meter,
                tier=tier,
                region=region,
                bucket_start=metering.from_ms(bucket),
                seq=seq,
                value=delta,
                state=ExportState.pending.value,
                created_at=now,
            )
        )
        report.events += 1
    elif live and all(as_aware(r.sent_at) >= now - CANCEL_WINDOW for r in live):
        for r in live:
            r.state = ExportState.cancel_pending.value
        report.cancels += len(live)
    else:
        _adjust(session, key, delta, "correction after Stripe's 24-hour cancel window", report)


def _adjust(session: Session, key: Key, quantity: int, reason: str, report: PlanReport) -> None:
    tenant, meter, tier, region, bucket = key
    session.add(
        BillingAdjustment(
            tenant_id=tenant,
            meter=meter,
            tier=tier,
            region=region,
            bucket_start=metering.from_ms(bucket),
            quantity=quantity,
            reason=reason,
        )
    )
    report.adjustments += 1


@dataclass
class SendReport:
    sent: int = 0
    duplicates: int = 0
    cancelled: int = 0
    failed: int = 0
    deferred: int = 0
    errors: list[str] = field(default_factory=list)


_calls = {"ok": 0}


def _fault_point() -> None:
    """Test hook: exit hard after the Nth successful Stripe answer, before it is marked (the
    crash the outbox must survive). Unset in production."""
    limit = int(os.environ.get(FAULT_ENV) or 0)
    if limit:
        _calls["ok"] += 1
        if _calls["ok"] >= limit:
            os._exit(75)


def send(limit: int = 1000) -> SendReport:
    """Send pending meter events and cancellations, oldest first; returns what happened."""
    report = SendReport()
    gw = gateway()
    if gw is None:
        return report
    sm = get_sessionmaker()
    todo = (ExportState.pending.value, ExportState.cancel_pending.value)
    with sm() as s:
        ids = list(
            s.scalars(
                select(MeterExport.id)
                .where(MeterExport.state.in_(todo))
                .order_by(MeterExport.id)
                .limit(limit)
            )
        )
    for row_id in ids:
        with sm() as s:
            stmt = select(MeterExport).where(MeterExport.id == row_id, MeterExport.state.in_(todo))
            if _is_pg(s):
                stmt = stmt.with_for_update(skip_locked=True)
            row = s.scalar(stmt)
            if row is None:
                continue
            if _is_pg(s) and not s.scalar(
                select(
                    func.pg_try_advisory_xact_lock(
                        _LOCK_NS + 1, func.hashtext(row.customer_id + "|" + row.meter)
                    )
                )
            ):
                report.deferred += 1  # another sender is calling for this customer and meter
                continue
            row.attempts += 1
            cancelling = row.state == ExportState.cancel_pending.value
            try:
                if cancelling:
                    gw.cancel_meter_event(event_name=row.meter, identifier=row.identifier)
                else:
                    gw.meter_event(
                        event_name=row.meter,
                        customer_id=row.customer_id,
                        value=row.value,
                        identifier=row.identifier,
                        timestamp=metering.to_ms(row.bucket_start) // 1000,
                    )
                _fault_point()
            except AlreadyRecorded:
                report.duplicates += 1
            except Rejected as exc:
                row.state, row.last_error = ExportState.failed.value, str(exc)[:1000]
                report.failed += 1
                report.errors.append(str(exc)[:200])
                s.commit()
                continue
            except RETRYABLE as exc:  # backed off and still refused: stop, the next run resumes
                row.last_error = str(exc)[:1000]
                s.commit()
                report.deferred += 1
                report.errors.append(str(exc)[:200])
                break
            now = utcnow()
            if cancelling:
                row.state, row.cancelled_at = ExportState.cancelled.value, now
                report.cancelled += 1
            else:
                row.state, row.sent_at = ExportState.sent.value, now
                report.sent += 1
            row.last_error = None
            s.commit()
    return report


def reconcile(
    session: Session, auth: AuthContext, period: str, now: datetime | None = None
) -> dict[str, Any]:
    """Per tenant and meter, for the month's closed buckets: the ledger's usage against what
    Stripe was sent (live meter events) plus adjustments; `difference` should be zero once the
    exporter has caught up, and `pending` says what is still on its way."""
    now = now or utcnow()
    start, end = period_window(period)
    hi = min(metering.to_ms(end), closed_until(now))
    lo = metering.to_ms(start)
    customers = _customers(session, auth)
    rows: dict[tuple[uuid.UUID, str], dict[str, int]] = defaultdict(
        lambda: {"ledger": 0, "exported": 0, "adjusted": 0, "pending": 0, "failed": 0}
    )
    if hi > lo and customers:
        for (tenant, meter, *_), q in ledger_by_key(
            session, metering.visible_to(auth, list(customers)), lo, hi, now
        ).items():
            rows[(tenant, meter)]["ledger"] += q
        window = (metering.from_ms(lo), metering.from_ms(hi))
        for r in session.scalars(
            restrict(auth, select(MeterExport), MeterExport).where(
                MeterExport.bucket_start >= window[0], MeterExport.bucket_start < window[1]
            )
        ):
            if r.tenant_id not in customers:
                continue
            slot = rows[(r.tenant_id, r.meter)]
            if r.state in (ExportState.sent.value, ExportState.cancel_pending.value):
                slot["exported"] += r.value
            if r.state in (ExportState.pending.value, ExportState.cancel_pending.value):
                slot["pending"] += 1
            if r.state == ExportState.failed.value:
                slot["failed"] += 1
        for a in session.scalars(
            restrict(auth, select(BillingAdjustment), BillingAdjustment).where(
                BillingAdjustment.bucket_start >= window[0],
                BillingAdjustment.bucket_start < window[1],
            )
        ):
            if a.tenant_id in customers:
                rows[(a.tenant_id, a.meter)]["adjusted"] += a.quantity
    out = []
    for (tenant, meter), v in sorted(rows.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        out.append(
            {
                "tenant_id": tenant,
                "stripe_customer_id": customers[tenant],
                "meter": meter,
                "ledger_milli_gpu_ms": v["ledger"],
                "exported_milli_gpu_ms": v["exported"],
                "adjusted_milli_gpu_ms": v["adjusted"],
                "difference_milli_gpu_ms": v["ledger"] - v["exported"] - v["adjusted"],
                "pending_events": v["pending"],
                "failed_events": v["failed"],
            }
        )
    return {
        "period": period,
        "start": start,
        "through": metering.from_ms(max(hi, lo)),
        "rows": out,
        "differences": sum(1 for r in out if r["difference_milli_gpu_ms"] != 0),
    }


def replan_all(session: Session) -> None:
    """Ask the next planner run for a full pass (who can be billed for past buckets changed).
    It waits for a running planner's lock: call it from tasks, not from the request path."""
    session.execute(update(MeterExportCursor).values(full_pass_at=None))
