from __future__ import annotations

from fastapi import Depends, Request
from pydantic import BaseModel

from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams
from app.keys.schemas import SignupKey
from app.keys.service import create_key
from app.models.tenants import Tenant, TenantStatus
from app.ratelimit import service as ratelimit
from app.tenancy.auth import Platform, TenantReadAnyStatus
from app.tenancy.scoping import get_owned
from app.tenants import service
from app.tenants.schemas import SignupRequest, TenantCreate, TenantOut, TenantUpdate

router = api_router(prefix="/v1", tags=["tenants"])
admin = api_router(prefix="/v1/admin", tags=["admin: tenants"])


class SignupResponse(BaseModel):
    tenant: TenantOut
    api_key: SignupKey


def _signup_limit(request: Request) -> None:
    # No key yet: signups are limited per client address.
    address = request.client.host if request.client else "unknown"
    ratelimit.check(request.scope, "signup", address=address)


@router.post(
    "/signup",
    status_code=201,
    response_model=SignupResponse,
    summary="Self-service signup: a pending tenant and its first admin key",
)
def signup(
    *, body: SignupRequest, _limit: None = Depends(_signup_limit), session: DbSession
) -> SignupResponse:
    tenant = service.create_tenant(
        session,
        name=body.name,
        slug=body.slug,
        contact_email=body.contact_email,
        status=TenantStatus.pending.value,
    )
    key = create_key(session, tenant_id=tenant.id, name="signup", scopes=["read", "write", "admin"])
    return SignupResponse(
        tenant=TenantOut.model_validate(tenant), api_key=SignupKey(**key.model_dump())
    )


@router.get("/tenant", response_model=TenantOut, summary="The calling tenant")
def get_self(auth: TenantReadAnyStatus, session: DbSession) -> Tenant:
    return get_owned(session, auth, Tenant, auth.tenant_id, what="tenant")


@admin.post("/tenants", status_code=201, response_model=TenantOut, summary="Create a tenant")
def create(body: TenantCreate, auth: Platform, session: DbSession) -> Tenant:
    return service.create_tenant(
        session,
        name=body.name,
        slug=body.slug,
        contact_email=body.contact_email,
        isolation_policy=body.isolation_policy,
        status=body.status.value,
    )


@admin.get("/tenants", response_model=Page[TenantOut], summary="List tenants")
def list_tenants(
    *,
    status: TenantStatus | None = None,
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = service.list_tenants(session, auth, page, status=status)
    return {"items": items, "next_cursor": nxt}


@admin.get("/tenants/{tenant_id:segment}", response_model=TenantOut, summary="Read a tenant")
def read(tenant_id: str, auth: Platform, session: DbSession) -> Tenant:
    return get_owned(session, auth, Tenant, tenant_id, what="tenant")


@admin.patch(
    "/tenants/{tenant_id:segment}",
    response_model=TenantOut,
    summary="Update a tenant: name, contact, isolation policy, status",
    description=(
        "The fields given change; a null one is left as it is. A status moves as the custom "
        "methods move it (active: `:approve` a pending tenant, `:reactivate` a suspended one; "
        "suspended: `:suspend`), with their 409s; nothing goes back to pending "
        "(409 tenant_status_refused)."
    ),
)
def update(tenant_id: str, body: TenantUpdate, auth: Platform, session: DbSession) -> Tenant:
    return service.update_tenant(
        session, get_owned(session, auth, Tenant, tenant_id, what="tenant"), body
    )


@admin.post(
    "/tenants/{tenant_id}:approve",
    response_model=TenantOut,
    summary="Approve a pending (self-service) tenant",
)
def approve(tenant_id: str, auth: Platform, session: DbSession) -> Tenant:
    return service.approve(get_owned(session, auth, Tenant, tenant_id, what="tenant"))


@admin.post(
    "/tenants/{tenant_id}:suspend",
    response_model=TenantOut,
    summary="Suspend an active tenant: its keys stop working",
    description=(
        "From the next request, the tenant's keys may only read the tenant itself "
        "(`GET /v1/tenant`); everything else is a 403 `tenant_not_active`, as for a pending "
        "tenant. Its queued and running workloads carry on (and are billed); terminate them "
        "to stop them. 409 `tenant_not_active` unless the tenant is active."
    ),
)
def suspend(tenant_id: str, auth: Platform, session: DbSession) -> Tenant:
    return service.suspend(get_owned(session, auth, Tenant, tenant_id, what="tenant"))


@admin.post(
    "/tenants/{tenant_id}:reactivate",
    response_model=TenantOut,
    summary="Reactivate a suspended tenant: its keys work again",
    description="409 `tenant_not_suspended` unless the tenant is suspended.",
)
def reactivate(tenant_id: str, auth: Platform, session: DbSession) -> Tenant:
    return service.reactivate(get_owned(session, auth, Tenant, tenant_id, what="tenant"))
