"""Workload logs: each replica's output (stdout and stderr together), as its node agent ships
it, in chunks at their byte offset in the run's output. A run is (workload, attempt, replica);
a chunk sent again (same run and offset) is stored once."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, utcnow


class WorkloadLog(Base):
    """One chunk of a run's output. Rows are appended in arrival order (`id`), which is the
    order readers follow; the oldest of a workload's chunks go first when it passes its byte
    cap, and every chunk once it is older than the retention."""

    __tablename__ = "workload_logs"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        UniqueConstraint("workload_id", "attempt", "replica", "offset"),
        # A workload's chunks in arrival order: every read, the tail and the byte cap.
        Index("ix_workload_logs_workload_id_id", "workload_id", "id"),
        # SQLite: never reuse an id after the newest rows are deleted (readers resume by id).
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    workload_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("workloads.id", ondelete="CASCADE"))
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    attempt: Mapped[int] = mapped_column(Integer)
    replica: Mapped[int] = mapped_column(Integer)
    # Where `data` starts in the run's output, in bytes (the agent's count, before any repair
    # of the text).
    offset: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[str] = mapped_column(Text)
    # The chunk's size in bytes (UTF-8): what the per-workload cap counts.
    bytes: Mapped[int] = mapped_column(Integer)
    # When the agent read it (the agent's clock), and when the control plane stored it.
    at: Mapped[datetime] = mapped_column()
    received_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class WorkloadLogSize(Base):
    """How many bytes of output a workload keeps: the sum of its chunks' `bytes`, kept by the
    transactions that store and delete chunks, so the byte cap is checked per batch without
    reading the workload's chunks."""

    __tablename__ = "workload_log_sizes"

    workload_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), primary_key=True
    )
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # Per run (`"<attempt>/<replica>"`), where its deleted output ends (the cap's and the
    # retention's deletions): a chunk sent again from before that is not stored a second time.
    dropped_below: Mapped[dict] = mapped_column(JSON, default=dict)
