from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.errors import Conflict
from app.core.schemas import paginate
from app.models.tenants import DEFAULT_ISOLATION_POLICY, RUN_GID_BASE, Tenant, TenantStatus
from app.outbox.service import enqueue
from app.tenancy.scoping import scoped_select
from app.tenants.schemas import TenantUpdate


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
    _with_run_gid(session, tenant)
    if get_settings().stripe_api_key:
        # The Stripe customer is created after commit, by a task (retried until Stripe answers).
        enqueue(session, "billing.ensure_customer", queue="billing", tenant_id=str(tenant.id))
    return tenant


def _with_run_gid(session: Session, tenant: Tenant) -> None:
    """Add the tenant with the next free group id; two signups racing for one take turns (the
    unique constraint refuses the second, which tries the next)."""
    for _ in range(20):
        top = session.scalar(select(func.max(Tenant.run_gid)))
        tenant.run_gid = RUN_GID_BASE if top is None else top + 1
        try:
            with session.begin_nested():
                session.add(tenant)
                session.flush()
            return
        except IntegrityError:
            if session.scalar(select(Tenant.id).where(Tenant.slug == tenant.slug)):
                raise Conflict(
                    f"A tenant with slug '{tenant.slug}' already exists.", code="tenant_slug_taken"
                ) from None
    raise Conflict("Too many tenants were created at once; try again.", code="concurrent_update")


# A tenant's status, and what its keys may do in each (app/tenancy/auth.py's
# `require_tenant_scope`): `active` uses the API; `pending` (a self-service signup not yet
# approved) and `suspended` (stopped by an operator) may only read the tenant itself
# (`GET /v1/tenant`, GraphQL `viewer`): every other request is a 403 `tenant_not_active`,
# bills included, from the next request on (cached keys are dropped on commit). Suspension
# stops the API, not the work: workloads already queued or running carry on (terminate them
# to stop them) and are metered and billed as usual. The moves:
#   pending -> active (approve); active -> suspended (suspend); suspended -> active
#   (reactivate). Nothing goes back to pending.


# Each move: (the status it starts from, the status it ends in, the refusal's code).
_MOVES = {
    "approve": (TenantStatus.pending, TenantStatus.active, "tenant_not_pending"),
    "suspend": (TenantStatus.active, TenantStatus.suspended, "tenant_not_active"),
    "reactivate": (TenantStatus.suspended, TenantStatus.active, "tenant_not_suspended"),
}
_DONE = {"approve": "approved", "suspend": "suspended", "reactivate": "reactivated"}


def move(tenant: Tenant, name: str) -> Tenant:
    """One of the moves above, or 409 with its code when the tenant is not where it starts."""
    start, end, code = _MOVES[name]
    if tenant.status != start.value:
        raise Conflict(
            f"Only {start.value} tenants can be {_DONE[name]}; this one is {tenant.status}.",
            code=code,
        )
    tenant.status = end.value
    return tenant


def approve(tenant: Tenant) -> Tenant:
    return move(tenant, "approve")


def suspend(tenant: Tenant) -> Tenant:
    """Stop an active tenant's keys (all but reading the tenant itself)."""
    return move(tenant, "suspend")


def reactivate(tenant: Tenant) -> Tenant:
    """Let a suspended tenant's keys work again."""
    return move(tenant, "reactivate")


def set_status(tenant: Tenant, status: str) -> Tenant:
    """A status asked for by value (PATCH): the move that reaches it from where the tenant is,
    by the same rules; the status it already has is no change."""
    if status == tenant.status:
        return tenant
    for name, (start, end, _) in _MOVES.items():
        if end.value == status and start.value == tenant.status:
            return move(tenant, name)
    if status == TenantStatus.suspended.value:
        return move(tenant, "suspend")  # refused with its code: only active tenants
    raise Conflict(
        f"A tenant does not go back to {status}; this one is {tenant.status}.",
        code="tenant_status_refused",
    )


def update_tenant(session: Session, tenant: Tenant, body: TenantUpdate) -> Tenant:
    """An operator's change of a tenant's name, contact, isolation policy or status (the
    fields given; a null one is left as it is). The status moves as `set_status` allows."""
    changes = body.model_dump(exclude_unset=True, mode="json")
    status = changes.pop("status", None)
    for field, value in changes.items():
        if value is not None:
            setattr(tenant, field, value)
    if status is not None:
        set_status(tenant, status)
    session.flush()
    return tenant


def list_tenants(session: Session, auth, page, *, status: TenantStatus | None = None):
    """Tenants the caller may see (operators: all), oldest first, a page at a time."""
    stmt = scoped_select(auth, Tenant)
    if status is not None:
        stmt = stmt.where(Tenant.status == status.value)
    return paginate(session, stmt, Tenant, page)
