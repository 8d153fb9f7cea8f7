from __future__ import annotations

from fastapi import Depends

from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams
from app.keys.schemas import KeyCreate, KeyCreated, KeyOut
from app.keys.service import create_key, revoke
from app.keys.service import list_keys as keys_page
from app.models.keys import ApiKey
from app.models.tenants import Tenant
from app.tenancy.auth import Platform, TenantAdmin, TenantRead
from app.tenancy.scoping import get_owned

router = api_router(prefix="/v1", tags=["keys"])
admin = api_router(prefix="/v1/admin", tags=["admin: tenants"])


@router.get("/keys", response_model=Page[KeyOut], summary="List the tenant's API keys")
def list_keys(*, page: PageParams = Depends(), auth: TenantRead, session: DbSession) -> dict:
    items, nxt = keys_page(session, auth, page)
    return {"items": items, "next_cursor": nxt}


@router.post(
    "/keys",
    status_code=201,
    response_model=KeyCreated,
    summary="Create an API key (the secret is shown once)",
)
def create(body: KeyCreate, auth: TenantAdmin, session: DbSession) -> KeyCreated:
    return create_key(
        session,
        tenant_id=auth.tenant_id,
        name=body.name,
        scopes=list(body.scopes),
        expires_at=body.expires_at,
    )


@router.get("/keys/{key_id}", response_model=KeyOut, summary="Read an API key")
def read(key_id: str, auth: TenantRead, session: DbSession) -> ApiKey:
    return get_owned(session, auth, ApiKey, key_id, what="key")


@router.delete(
    "/keys/{key_id}",
    response_model=KeyOut,
    summary="Revoke an API key (effective on the next request)",
)
def delete(key_id: str, auth: TenantAdmin, session: DbSession) -> ApiKey:
    return revoke(get_owned(session, auth, ApiKey, key_id, what="key"))


@admin.post(
    "/tenants/{tenant_id}/keys",
    status_code=201,
    response_model=KeyCreated,
    summary="Create an API key for a tenant",
)
def admin_create(tenant_id: str, body: KeyCreate, auth: Platform, session: DbSession) -> KeyCreated:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    return create_key(
        session,
        tenant_id=tenant.id,
        name=body.name,
        scopes=list(body.scopes),
        expires_at=body.expires_at,
    )


@admin.get("/tenants/{tenant_id}/keys", response_model=Page[KeyOut], summary="List a tenant's keys")
def admin_list(
    *, tenant_id: str, page: PageParams = Depends(), auth: Platform, session: DbSession
) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    items, nxt = keys_page(session, auth, page, tenant_id=tenant.id)
    return {"items": items, "next_cursor": nxt}


@admin.delete("/keys/{key_id}", response_model=KeyOut, summary="Revoke any API key")
def admin_revoke(key_id: str, auth: Platform, session: DbSession) -> ApiKey:
    return revoke(get_owned(session, auth, ApiKey, key_id, what="key"))
