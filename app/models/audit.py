"""The audit log: one append-only row per mutating request and per automatic action."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, ForeignKey, Index, SmallInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, new_id, utcnow


class AuditEntry(Base):
    """Who did what to which object, when, and how it ended. Never updated or deleted by the
    application; the database refuses UPDATE and DELETE (triggers, migration 0015). No secret
    and no request body is kept: the key is named by id and public prefix only."""

    __tablename__ = "audit_log"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        # A tenant's entries in time order (its cursor pages), and everyone's for operators.
        Index("ix_audit_log_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_audit_log_created", "created_at", "id"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # tenant (a tenant's key), operator (a platform key), system (the control plane itself),
    # anonymous (signup, or a key that did not authenticate).
    principal: Mapped[str] = mapped_column(String(16))
    key_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    key_prefix: Mapped[str | None] = mapped_column(String(16), default=None)
    # Whose the entry is: the acting tenant, or the tenant an operator or the system acted on.
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), default=None
    )
    action: Mapped[str] = mapped_column(String(120))  # "POST /v1/workloads", "workload.preempt"
    target_type: Mapped[str | None] = mapped_column(String(32), default=None)
    target_id: Mapped[str | None] = mapped_column(String(64), default=None)
    request_id: Mapped[str | None] = mapped_column(String(128), default=None)
    status: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    # What the tenant may read, and (operators only) what names other tenants' objects.
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    internal: Mapped[dict] = mapped_column(JSON, default=dict)
