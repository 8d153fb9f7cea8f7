from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin


class IdempotencyRecord(TimestampMixin, Base):
    """The stored outcome of a POST sent with an Idempotency-Key, per API key (principal)."""

    __tablename__ = "idempotency_records"
    __table_args__ = (UniqueConstraint("principal", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    principal: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    # NULL while the first request is still being handled.
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    response_headers: Mapped[dict | None] = mapped_column(JSON, default=None)
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)
