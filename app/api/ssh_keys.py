"""/v1/ssh-keys: a tenant's SSH public keys (app/keys/ssh_keys.py), and operators' view of a
tenant's, as /v1/keys and /v1/admin/tenants/{tenant_id}/keys are for API keys."""

from __future__ import annotations

from fastapi import Depends

from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams
from app.keys.schemas import SshKeyCreate, SshKeyOut
from app.keys.ssh_keys import add_ssh_key, delete_ssh_key, get_ssh_key, list_ssh_keys
from app.models.keys import SshKey
from app.models.tenants import Tenant
from app.tenancy.auth import Platform, TenantRead, TenantWrite
from app.tenancy.scoping import get_owned

router = api_router(prefix="/v1", tags=["ssh keys"])
admin = api_router(prefix="/v1/admin", tags=["admin: tenants"])


@router.get("/ssh-keys", response_model=Page[SshKeyOut], summary="List your SSH keys")
def list_keys(*, page: PageParams = Depends(), auth: TenantRead, session: DbSession) -> dict:
    items, nxt = list_ssh_keys(session, auth, page)
    return {"items": items, "next_cursor": nxt}


@router.post(
    "/ssh-keys",
    status_code=201,
    response_model=SshKeyOut,
    summary="Add an SSH public key (ed25519, ECDSA, RSA of 3072 bits or more; never a private "
    "key) for the instances you launch",
)
def add(body: SshKeyCreate, auth: TenantWrite, session: DbSession) -> SshKey:
    return add_ssh_key(
        session, tenant_id=auth.tenant_id, name=body.name, public_key=body.public_key
    )


@router.get("/ssh-keys/{ssh_key_id}", response_model=SshKeyOut, summary="Read an SSH key")
def read(ssh_key_id: str, auth: TenantRead, session: DbSession) -> SshKey:
    return get_ssh_key(session, auth, ssh_key_id)


@router.delete("/ssh-keys/{ssh_key_id}", status_code=204, summary="Delete an SSH key")
def delete(ssh_key_id: str, auth: TenantWrite, session: DbSession) -> None:
    delete_ssh_key(session, get_ssh_key(session, auth, ssh_key_id, for_update=True))


@admin.get(
    "/tenants/{tenant_id}/ssh-keys",
    response_model=Page[SshKeyOut],
    summary="List a tenant's SSH keys",
)
def admin_list(
    *, tenant_id: str, page: PageParams = Depends(), auth: Platform, session: DbSession
) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    items, nxt = list_ssh_keys(session, tenant.id, page)
    return {"items": items, "next_cursor": nxt}


@admin.delete("/ssh-keys/{ssh_key_id}", status_code=204, summary="Delete any tenant's SSH key")
def admin_delete(ssh_key_id: str, auth: Platform, session: DbSession) -> None:
    delete_ssh_key(session, get_ssh_key(session, auth, ssh_key_id, for_update=True))
