from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id


class BrowserSession(TimestampMixin, Base):
    """A portal sign-in: an API key traded for a token that lives in an HttpOnly cookie. Only
    the token's HMAC is stored. It acts as its key does now (revoke the key and its sessions
    end), until it is signed out, unused for the idle time, or past `expires_at`."""

    __tablename__ = "browser_sessions"
    __tenant_column__ = "tenant_id"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    last_seen_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    user_agent: Mapped[str] = mapped_column(String(200), default="")
