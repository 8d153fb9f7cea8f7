from __future__ import annotations

import enum
import uuid

from sqlalchemy import JSON, Integer, String
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


# Tenants' group ids on nodes start here (above the agents' default run uids, 2000000-2065535).
RUN_GID_BASE = 3_000_000

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
    # The tenant's group on every node: each of its runs has a uid of its own and this gid, so
    # its runs share files (checkpoints on a shared disk) with each other and no other tenant.
    run_gid: Mapped[int] = mapped_column(Integer, unique=True)
    name: Mapped[str] = mapped_column(String(200))
    contact_email: Mapped[str] = mapped_column(String(320))
    status: Mapped[str] = mapped_column(String(16), default=TenantStatus.active.value)
    isolation_policy: Mapped[list[str]] = mapped_column(
        JSON, default=lambda: list(DEFAULT_ISOLATION_POLICY)
    )
    # The Stripe customer, created when the tenant is onboarded (None until then, or without
    # Stripe configured).
    stripe_customer_id: Mapped[str | None] = mapped_column(String(255), default=None)
