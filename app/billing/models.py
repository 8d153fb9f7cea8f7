"""The price book: prices per GPU-hour-equivalent in integer minor units, by SKU (GPU model and
shape), isolation tier, region and plan, each a numbered version effective from a date. A price
change is a new version; old versions stay, so any past period can be priced again."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id


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
