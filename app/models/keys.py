from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id


class ApiKey(TimestampMixin, Base):
    """An API key. Only a hash of the secret is stored; `prefix` is the public lookup id.

    `tenant_id` is NULL for platform (operator) keys.
    """

    __tablename__ = "api_keys"
    __tenant_column__ = "tenant_id"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)


class SshKey(TimestampMixin, Base):
    """A tenant's SSH public key, for the instances it launches (cloud-init, a container's
    authorized_keys). Stored normalised: `public_key` is `TYPE BASE64` (as OpenSSH writes it,
    without the comment, which is kept apart); `fingerprint` is ssh-keygen -l's `SHA256:...`.
    Never a private key: app/keys/ssh.py refuses one before anything is written."""

    __tablename__ = "ssh_keys"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name"),
        UniqueConstraint("tenant_id", "fingerprint"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    # Its unique constraints lead with tenant_id: they are the tenant's index.
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    key_type: Mapped[str] = mapped_column(String(32))
    bits: Mapped[int]
    public_key: Mapped[str] = mapped_column(String(4096))
    comment: Mapped[str | None] = mapped_column(String(255), default=None)
    fingerprint: Mapped[str] = mapped_column(String(64))
