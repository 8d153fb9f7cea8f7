from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Integer, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin


class IdempotencyRecord(TimestampMixin, Base):
    """The stored outcome of a POST sent with an Idempotency-Key, per account (tenant or
    operators), handed back only to the key that made it."""

    __tablename__ = "idempotency_records"
    __table_args__ = (UniqueConstraint("principal", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    principal: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    # Who may be handed the stored answer: the API key that made the request and the standing
    # its tenant had then (`owner_of`); NULL for anonymous requests.
    owner: Mapped[str | None] = mapped_column(String(64), default=None)
    # NULL while the first request is still being handled.
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    response_headers: Mapped[dict | None] = mapped_column(JSON, default=None)
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)
    # Set by the request's own transaction (app.idempotency.middleware.before_commit): once it
    # is, the request's work is in the database, whatever became of its answer.
    applied_at: Mapped[datetime | None] = mapped_column(default=None)
