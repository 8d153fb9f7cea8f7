"""Workloads, their event timeline, and tenant quotas."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id
from app.workloads.lifecycle import State


class Workload(TimestampMixin, Base):
    __tablename__ = "workloads"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        CheckConstraint("replicas >= 1", name="replicas_positive"),
        CheckConstraint("max_runtime_s > 0", name="max_runtime_positive"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), index=True
    )
    name: Mapped[str | None] = mapped_column(String(200), default=None)
    kind: Mapped[str] = mapped_column(String(16))  # instance | vm | job
    state: Mapped[str] = mapped_column(String(16), default=State.pending.value, index=True)
    # The tier chosen at submission (placement core label): what may share hardware with it,
    # and what metering bills.
    tier: Mapped[str] = mapped_column(String(24))
    priority: Mapped[str] = mapped_column(String(24))
    # Per replica: gpu_models, gpus | mig_profile | milli + gpu_memory_mib, cpu_milli, memory_mib.
    shape: Mapped[dict] = mapped_column(JSON)
    replicas: Mapped[int] = mapped_column(Integer, default=1)
    gpu_milli: Mapped[int] = mapped_column(Integer)  # GPU-equivalents of all replicas
    topology: Mapped[dict | None] = mapped_column(JSON, default=None)
    region: Mapped[str | None] = mapped_column(String(63), default=None)
    max_runtime_s: Mapped[int] = mapped_column(Integer)
    checkpoint_interval_s: Mapped[int | None] = mapped_column(Integer, default=None)
    checkpoint_cost_s: Mapped[int] = mapped_column(Integer, default=0)
    labels: Mapped[dict] = mapped_column(JSON, default=dict)
    placement: Mapped[list | None] = mapped_column(JSON, default=None)
    last_checkpoint_at: Mapped[datetime | None] = mapped_column(default=None)
    last_checkpoint_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    preempted_at: Mapped[datetime | None] = mapped_column(default=None)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    # Bumped on every state change (optimistic concurrency for workers applying plans).
    generation: Mapped[int] = mapped_column(Integer, default=0)


class WorkloadEvent(Base):
    """One row per transition (and per reported checkpoint): the workload's timeline."""

    __tablename__ = "workload_events"
    __tenant_column__ = "tenant_id"
    __table_args__ = (UniqueConstraint("workload_id", "seq"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    workload_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), index=True
    )
    seq: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # transition | checkpoint
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(500))
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    at: Mapped[datetime] = mapped_column()


class TenantQuota(TimestampMixin, Base):
    """Per tenant and GPU model, in GPU-equivalent milli (whole GPU 1000, MIG memory/8, a share
    its milli): `guaranteed` capacity, an optional hard `limit`, and a fair-share weight."""

    __tablename__ = "tenant_quotas"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        UniqueConstraint("tenant_id", "gpu_model"),
        CheckConstraint("guaranteed_milli >= 0", name="guaranteed_nonnegative"),
        CheckConstraint(
            "limit_milli IS NULL OR limit_milli >= guaranteed_milli", name="limit_covers_guarantee"
        ),
        CheckConstraint("weight > 0", name="weight_positive"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    gpu_model: Mapped[str] = mapped_column(String(32))
    guaranteed_milli: Mapped[int] = mapped_column(Integer, default=0)
    limit_milli: Mapped[int | None] = mapped_column(Integer, default=None)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
