"""The price book: prices per GPU-hour-equivalent in integer minor units, by SKU (GPU model and
shape), isolation tier, region and plan, each a numbered version effective from a date. A price
change is a new version; old versions stay, so any past period can be priced again."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id, utcnow


class Plan(str, enum.Enum):
    on_demand = "on_demand"
    reserved = "reserved"
    preemptible = "preemptible"


class Price(TimestampMixin, Base):
    __tablename__ = "prices"
    __table_args__ = (
        UniqueConstraint(
            "gpu_model", "shape", "tier", "region", "plan", "version", name="price_version"
        ),
        CheckConstraint("unit_amount >= 0", name="unit_amount_not_negative"),
        CheckConstraint("plan IN ('on_demand', 'reserved', 'preemptible')", name="plan_known"),
        CheckConstraint("length(currency) = 3", name="currency_iso"),
        Index("ix_prices_lookup", "gpu_model", "plan", "effective_from"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    gpu_model: Mapped[str] = mapped_column(String(32))
    # whole | fractional | vm | mig (any profile) | mig-<profile>
    shape: Mapped[str] = mapped_column(String(24))
    # '*' matches any tier or region; a specific one wins over '*'.
    tier: Mapped[str] = mapped_column(String(24), default="*")
    region: Mapped[str] = mapped_column(String(63), default="*")
    plan: Mapped[str] = mapped_column(String(16))
    currency: Mapped[str] = mapped_column(String(3))
    # Minor units (cents) per GPU-hour of GPU-equivalents held.
    unit_amount: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)
    effective_from: Mapped[datetime] = mapped_column()


class Budget(TimestampMixin, Base):
    """A tenant's monthly budget: a spend limit (minor units of one currency) and/or a GPU-hour
    limit. The evaluator keeps `spent`/`used` current and marks the month exhausted when a limit
    is reached; submissions are then refused, and running preemptible work is stopped if the
    tenant chose so."""

    __tablename__ = "budgets"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        CheckConstraint("spend_limit IS NULL OR spend_limit >= 0", name="spend_limit_positive"),
        CheckConstraint(
            "gpu_hour_limit IS NULL OR gpu_hour_limit >= 0", name="gpu_hour_limit_positive"
        ),
        CheckConstraint("length(currency) = 3", name="currency_iso"),
    )

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    currency: Mapped[str] = mapped_column(String(3))
    spend_limit: Mapped[int | None] = mapped_column(BigInteger, default=None)
    gpu_hour_limit: Mapped[int | None] = mapped_column(BigInteger, default=None)
    stop_preemptible: Mapped[bool] = mapped_column(Boolean, default=False)
    # Set by the evaluator: the month (YYYY-MM) it found a limit reached in, else None.
    exhausted_period: Mapped[str | None] = mapped_column(String(7), default=None)
    period: Mapped[str | None] = mapped_column(String(7), default=None)
    spent: Mapped[int] = mapped_column(BigInteger, default=0)
    used_milli_gpu_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    evaluated_at: Mapped[datetime | None] = mapped_column(default=None)


class BudgetAlert(Base):
    """A threshold (50, 80 or 100 % of a limit) crossed in a month; written once (the unique key),
    for the portal to show."""

    __tablename__ = "budget_alerts"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        UniqueConstraint(
            "tenant_id", "period", "metric", "threshold_pct", name="budget_alert_once"
        ),
        CheckConstraint("metric IN ('spend', 'gpu_hours')", name="metric_known"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    period: Mapped[str] = mapped_column(String(7))
    metric: Mapped[str] = mapped_column(String(16))
    threshold_pct: Mapped[int] = mapped_column(Integer)
    # What was used (minor units, or milli-GPU-ms) and the limit (same unit) when it crossed.
    used: Mapped[int] = mapped_column(BigInteger)
    limit: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ExportState(str, enum.Enum):
    pending = "pending"  # to send
    sent = "sent"  # Stripe took it (or already had its identifier)
    cancel_pending = "cancel_pending"  # a correction: to cancel by identifier, then re-send
    cancelled = "cancelled"
    failed = "failed"  # Stripe refused it as invalid: reconciliation shows it, an operator acts


class MeterExport(Base):
    """The Stripe outbox: one meter event per row, with a deterministic identifier. A crash
    between Stripe's answer and marking the row sent re-sends the same identifier, which Stripe
    de-duplicates. Rows are planned from the ledger per tenant, meter, tier, region and bucket;
    a later correction adds a row (more usage) or cancels and re-sends (less usage)."""

    __tablename__ = "meter_exports"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        UniqueConstraint(
            "tenant_id", "meter", "tier", "region", "bucket_start", "seq", name="meter_export_seq"
        ),
        CheckConstraint("value >= 0", name="value_not_negative"),
        CheckConstraint(
            "state IN ('pending', 'sent', 'cancel_pending', 'cancelled', 'failed')",
            name="state_known",
        ),
        Index("ix_meter_exports_state", "state", "id"),
        Index("ix_meter_exports_bucket", "bucket_start"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    identifier: Mapped[str] = mapped_column(String(100), unique=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    customer_id: Mapped[str] = mapped_column(String(255))
    meter: Mapped[str] = mapped_column(String(100))
    tier: Mapped[str] = mapped_column(String(24))
    region: Mapped[str] = mapped_column(String(63))
    bucket_start: Mapped[datetime] = mapped_column()
    seq: Mapped[int] = mapped_column(Integer)
    value: Mapped[int] = mapped_column(BigInteger)  # milli-GPU-ms
    state: Mapped[str] = mapped_column(String(16), default=ExportState.pending.value)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None] = mapped_column(default=None)
    cancelled_at: Mapped[datetime | None] = mapped_column(default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)


class BillingAdjustment(Base):
    """A correction Stripe's meter can no longer take: less usage found after its event's
    24-hour cancel window (a credit, negative), or usage for a bucket older than Stripe's
    35-day timestamp window (a charge). Finance applies these to the invoice; reconciliation
    counts them as exported."""

    __tablename__ = "billing_adjustments"
    __tenant_column__ = "tenant_id"
    __table_args__ = (Index("ix_billing_adjustments_key", "tenant_id", "meter", "bucket_start"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    meter: Mapped[str] = mapped_column(String(100))
    tier: Mapped[str] = mapped_column(String(24))
    region: Mapped[str] = mapped_column(String(63))
    bucket_start: Mapped[datetime] = mapped_column()
    quantity: Mapped[int] = mapped_column(BigInteger)  # signed milli-GPU-ms
    reason: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MeterExportCursor(Base):
    """How far the planner has looked (one row): buckets before `planned_through` are planned,
    ledger events recorded after `last_run_at` are re-examined for late corrections, and the
    whole window is compared again every RACKPLANE_METER_FULL_PASS seconds."""

    __tablename__ = "meter_export_cursor"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, default=1)
    planned_through: Mapped[datetime | None] = mapped_column(default=None)
    last_run_at: Mapped[datetime | None] = mapped_column(default=None)
    # The last run that compared the whole window; None asks the next run to (a new customer,
    # a commitment that re-prices the past).
    full_pass_at: Mapped[datetime | None] = mapped_column(default=None)


class Commitment(TimestampMixin, Base):
    """A tenant's reserved capacity: `gpus_milli` GPU-equivalents of one GPU model (in one
    region, or any: '*') over [starts_at, ends_at), on whole hours. At every instant of the term,
    the tenant's non-preemptible usage of that model, up to the commitment, is priced at the
    reserved price, the rest on demand; any part of the commitment left unused is still owed, at
    the reserved price of a whole GPU (that is what committing means). See
    app/billing/commitments.py."""

    __tablename__ = "commitments"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        CheckConstraint("gpus_milli > 0", name="gpus_milli_positive"),
        CheckConstraint("ends_at > starts_at", name="term_not_empty"),
        Index("ix_commitments_tenant_term", "tenant_id", "gpu_model", "starts_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    gpu_model: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(63), default="*")
    gpus_milli: Mapped[int] = mapped_column(BigInteger)
    starts_at: Mapped[datetime] = mapped_column()
    ends_at: Mapped[datetime] = mapped_column()
    reference: Mapped[str | None] = mapped_column(String(200), default=None)
