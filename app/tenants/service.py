from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.errors import Conflict
from app.outbox.service import enqueue
from app.tenants.models import DEFAULT_ISOLATION_POLICY, Tenant, TenantStatus


def create_tenant(
    session: Session,
    *,
    name: str,
    slug: str,
    contact_email: str,
    isolation_policy: list[str] | None = None,
    status: str = TenantStatus.active.value,
) -> Tenant:
    if session.scalar(select(Tenant.id).where(Tenant.slug == slug)) is not None:
        raise Conflict(f"A tenant with slug '{slug}' already exists.", code="tenant_slug_taken")
    tenant = Tenant(
        name=name,
        slug=slug,
        contact_email=str(contact_email),
        status=status,
        isolation_policy=[
            str(getattr(t, "value", t)) for t in (isolation_policy or DEFAULT_ISOLATION_POLICY)
        ],
    )
    session.add(tenant)
    session.flush()
    if get_settings().stripe_api_key:
        # The Stripe customer is created after commit, by a task (retried until Stripe answers).
        enqueue(session, "billing.ensure_customer", queue="billing", tenant_id=str(tenant.id))
    return tenant


def approve(tenant: Tenant) -> Tenant:
    if tenant.status != TenantStatus.pending.value:
        raise Conflict(
            f"Only pending tenants can be approved; this one is {tenant.status}.",
            code="tenant_not_pending",
        )
    tenant.status = TenantStatus.active.value
    return tenant


def list_tenants(session: Session, auth, page, *, status: TenantStatus | None = None):
    """Tenants the caller may see (operators: all), oldest first, a page at a time."""
    from app.core.schemas import paginate
    from app.tenancy.scoping import scoped_select

    stmt = scoped_select(auth, Tenant)
    if status is not None:
        stmt = stmt.where(Tenant.status == status.value)
    return paginate(session, stmt, Tenant, page)
