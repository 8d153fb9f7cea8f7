"""The usage ledger: append-only events, one unique key each.

Usage is derived, never stored as a running total: an allocation's `start` and `stop` events
bound an interval, and its quantity is `gpu_milli x (stop - start)` in milliseconds, an integer
(milli-GPU-milliseconds; 3.6e9 of them make one GPU-hour). Corrections are `adjustment` rows
with a signed quantity; no row is ever updated or deleted.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, utcnow


class UsageKind(str, enum.Enum):
    start = "start"
    stop = "stop"
    adjustment = "adjustment"


class UsageEvent(Base):
    __tablename__ = "usage_events"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        CheckConstraint("kind IN ('start', 'stop', 'adjustment')", name="kind_known"),
        CheckConstraint("gpu_milli >= 0", name="gpu_milli_not_negative"),
        CheckConstraint(
            "(kind = 'adjustment') = (quantity IS NOT NULL)", name="only_adjustments_carry_quantity"
        ),
        Index("ix_usage_events_tenant_at", "tenant_id", "occurred_at"),
        Index("ix_usage_events_allocation_kind", "allocation_id", "kind"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    # The idempotency key: `alloc:<id>:start`, `alloc:<id>:stop`, or the adjustment's own.
    event_key: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    allocation_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    workload_id: Mapped[uuid.UUID | None] = mapped_column(default=None, index=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    region: Mapped[str] = mapped_column(String(63))
    gpu_model: Mapped[str] = mapped_column(String(32))
    # whole | mig-<profile> | fractional | vm
    shape: Mapped[str] = mapped_column(String(24))
    tier: Mapped[str] = mapped_column(String(24))
    priority: Mapped[str] = mapped_column(String(24))
    # GPU-equivalents held, in milli-GPU (all GPUs of the allocation together).
    gpu_milli: Mapped[int] = mapped_column(Integer)
    occurred_at: Mapped[datetime] = mapped_column()
    # Adjustments only: signed milli-GPU-milliseconds.
    quantity: Mapped[int | None] = mapped_column(BigInteger, default=None)
    reason: Mapped[str | None] = mapped_column(String(200), default=None)
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)
