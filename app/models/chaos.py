"""Chaos experiments: faults injected through the seams real faults come through (the
telemetry the health loop consumes), never by writing health states or allocations."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, ForeignKey, Integer, SmallInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id


class ChaosExperiment(TimestampMixin, Base):
    __tablename__ = "chaos_experiments"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(12))  # scheduled | running | stopped | aborted
    abort_reason: Mapped[str | None] = mapped_column(String(300), default=None)
    spec: Mapped[dict] = mapped_column(JSON)  # what was asked, as asked
    gpus_touched: Mapped[int] = mapped_column(Integer, default=0)
    touched: Mapped[dict | None] = mapped_column(JSON, default=None)  # GPUs per region, all rounds
    started_at: Mapped[datetime] = mapped_column()
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)
    rounds: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_at: Mapped[datetime | None] = mapped_column(default=None, index=True)


class ChaosInjection(Base):
    """One fault injected on one GPU (or node), and when it was undone."""

    __tablename__ = "chaos_injections"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    experiment_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("chaos_experiments.id", ondelete="CASCADE"), index=True
    )
    # xid | ecc_dbe | throttle | node_loss | nvlink | provider
    kind: Mapped[str] = mapped_column(String(16))
    code: Mapped[int | None] = mapped_column(Integer, default=None)
    detail: Mapped[str | None] = mapped_column(String(16), default=None)  # provider: what fails
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(63))
    gpu_index: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    injected_at: Mapped[datetime] = mapped_column()
    undone_at: Mapped[datetime | None] = mapped_column(default=None)
