from __future__ import annotations

import enum
import uuid

from sqlalchemy import JSON, String
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id


class TenantStatus(str, enum.Enum):
    pending = "pending"
    active = "active"
    suspended = "suspended"


class IsolationTier(str, enum.Enum):
    """Tiers a tenant may be placed in. Performance and security isolation are separate axes;
    these names are the combinations we sell (see the placement core's isolation table)."""

    shared_timeslice = "shared-timeslice"
    shared_fractional = "shared-fractional"
    shared_mig = "shared-mig"
    dedicated_gpu = "dedicated-gpu"
    vm = "vm"
    confidential_vm = "confidential-vm"


# Default policy: the shared tiers are allowed, plus exclusive GPUs and VMs, which never share.
DEFAULT_ISOLATION_POLICY = [
    t.value for t in IsolationTier if t is not IsolationTier.confidential_vm
]


class Tenant(TimestampMixin, Base):
    __tablename__ = "tenants"
    # The scoping helper filters tenant-owned rows by this column.
    __tenant_column__ = "id"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    slug: Mapped[str] = mapped_column(String(63), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    contact_email: Mapped[str] = mapped_column(String(320))
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.active.value)
    isolation_policy: Mapped[list[str]] = mapped_column(
        JSON, default=lambda: list(DEFAULT_ISOLATION_POLICY)
    )
    # The Stripe customer, created when the tenant is onboarded (None until then, or without
    # Stripe configured).
    stripe_customer_id: Mapped[str | None] = mapped_column(String(255), default=None)
