from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, ForeignKey, LargeBinary, String, UniqueConstraint
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


class TenantSecret(TimestampMixin, Base):
    """A tenant's secret value (a token, a password), given to its workloads' processes as an
    environment variable by reference (`secret_env`). Stored sealed (AES-GCM under a key
    derived from the server's `RACKPLANE_SECRET_KEY`, bound to its tenant and name: a row moved
    to another tenant or name does not open); never returned by any route, read only when the
    node that starts a run asks for that run's environment."""

    __tablename__ = "tenant_secrets"
    __tenant_column__ = "tenant_id"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    # Its unique constraint leads with tenant_id: it is the tenant's index.
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    sealed: Mapped[bytes] = mapped_column(LargeBinary)
    # How many bytes the value holds (what a caller may see of it), and how often it was set.
    size: Mapped[int]
    version: Mapped[int] = mapped_column(default=1)
    updated_at: Mapped[datetime]
