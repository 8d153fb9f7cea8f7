from __future__ import annotations

from fastapi import Depends
from sqlalchemy.orm import Session

from app.core.db import session_dependency
from app.core.routing import api_router
from app.core.schemas import Page, PageParams, paginate
from app.keys.schemas import KeyCreate, KeyCreated, KeyOut
from app.keys.service import create_key, revoke
from app.models.keys import ApiKey
from app.models.tenants import Tenant
from app.tenancy.auth import AuthContext, platform, tenant_admin, tenant_read
from app.tenancy.scoping import get_owned, scoped_select

router = api_router(prefix="/v1", tags=["keys"])
admin = api_router(prefix="/v1/admin", tags=["admin: tenants"])


@router.get("/keys", response_model=Page[KeyOut], summary="List the tenant's API keys")
def list_keys(
    page: PageParams = Depends(),
    auth: AuthContext = Depends(tenant_read),
    session: Session = Depends(session_dependency),
) -> dict:
    items, nxt = paginate(session, scoped_select(auth, ApiKey), ApiKey, page)
    return {"items": items, "next_cursor": nxt}


@router.post(
    "/keys",
    status_code=201,
    response_model=KeyCreated,
    summary="Create an API key (the secret is shown once)",
)
def create(
    body: KeyCreate,
    auth: AuthContext = Depends(tenant_admin),
    session: Session = Depends(session_dependency),
) -> KeyCreated:
    return create_key(
        session,
        tenant_id=auth.tenant_id,
        name=body.name,
        scopes=list(body.scopes),
        expires_at=body.expires_at,
    )


@router.get("/keys/{key_id}", response_model=KeyOut, summary="Read an API key")
def read(
    key_id: str,
    auth: AuthContext = Depends(tenant_read),
    session: Session = Depends(session_dependency),
) -> ApiKey:
    return get_owned(session, auth, ApiKey, key_id, what="key")


@router.delete(
    "/keys/{key_id}",
    response_model=KeyOut,
    summary="Revoke an API key (effective on the next request)",
)
def delete(
    key_id: str,
    auth: AuthContext = Depends(tenant_admin),
    session: Session = Depends(session_dependency),
) -> ApiKey:
    return revoke(get_owned(session, auth, ApiKey, key_id, what="key"))


@admin.post(
    "/tenants/{tenant_id}/keys",
    status_code=201,
    response_model=KeyCreated,
    summary="Create an API key for a tenant",
)
def admin_create(
    tenant_id: str,
    body: KeyCreate,
    auth: AuthContext = Depends(platform),
    session: Session = Depends(session_dependency),
) -> KeyCreated:
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
    tenant_id: str,
    page: PageParams = Depends(),
    auth: AuthContext = Depends(platform),
    session: Session = Depends(session_dependency),
) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    items, nxt = paginate(
        session, scoped_select(auth, ApiKey).where(ApiKey.tenant_id == tenant.id), ApiKey, page
    )
    return {"items": items, "next_cursor": nxt}


@admin.delete("/keys/{key_id}", response_model=KeyOut, summary="Revoke any API key")
def admin_revoke(
    key_id: str,
    auth: AuthContext = Depends(platform),
    session: Session = Depends(session_dependency),
) -> ApiKey:
    return revoke(get_owned(session, auth, ApiKey, key_id, what="key"))
