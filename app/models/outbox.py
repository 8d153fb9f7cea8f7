from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin


class OutboxMessage(TimestampMixin, Base):
    """A task to send to Celery, written in the same transaction as the change that needs it."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    task: Mapped[str] = mapped_column(String(100))
    kwargs: Mapped[dict] = mapped_column(JSON)
    queue: Mapped[str] = mapped_column(String(50))
    # Run no earlier than this (Celery eta), e.g. the end of a victim's grace period.
    eta: Mapped[datetime | None] = mapped_column(default=None)
    sent_at: Mapped[datetime | None] = mapped_column(default=None, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
