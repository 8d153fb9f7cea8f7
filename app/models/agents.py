"""What lets a node agent talk to the control plane: single-use join tokens an operator makes for
a node, and the node credentials agents trade them for. Only hashes are stored."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, new_id, utcnow


class NodeJoinToken(Base):
    __tablename__ = "node_join_tokens"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class NodeCredential(Base):
    __tablename__ = "node_credentials"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    prefix: Mapped[str] = mapped_column(String(8))  # shown in the audit log, never the secret
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
