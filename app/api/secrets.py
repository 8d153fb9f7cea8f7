"""/v1/secrets: a tenant's secrets (app/keys/tenant_secrets.py), by name. A value goes in and
never comes out: reads show its size and version only; a workload names secrets in its
`secret_env`, and the node that starts each run is the one reader of their values."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Response

from app.core.routing import DbSession, api_router
from app.core.schemas import RESOURCE_NAME_PATTERN, Page, PageParams
from app.keys.schemas import SecretOut, SecretPut
from app.keys.tenant_secrets import delete_secret, get_secret, list_secrets, put_secret
from app.models.keys import TenantSecret
from app.tenancy.auth import TenantRead, TenantWrite

router = api_router(prefix="/v1", tags=["secrets"])

SecretName = Annotated[
    str,
    Path(
        pattern=RESOURCE_NAME_PATTERN,
        description="The secret's name: letters, digits, `.`, `_` and `-` (1 to 63)",
    ),
]


@router.get("/secrets", response_model=Page[SecretOut], summary="List your secrets (no values)")
def list_all(*, page: PageParams = Depends(), auth: TenantRead, session: DbSession) -> dict:
    items, nxt = list_secrets(session, auth, page)
    return {"items": items, "next_cursor": nxt}


@router.put(
    "/secrets/{secret_name}",
    response_model=SecretOut,
    responses={201: {"model": SecretOut, "description": "Created"}},
    summary="Set a secret's value (201 when new, 200 when replaced: the next runs get it)",
)
def put(
    secret_name: SecretName,
    body: SecretPut,
    auth: TenantWrite,
    session: DbSession,
    response: Response,
) -> TenantSecret:
    assert auth.tenant_id is not None
    row, created = put_secret(session, auth.tenant_id, secret_name, body.value)
    response.status_code = 201 if created else 200
    return row


@router.get(
    "/secrets/{secret_name}", response_model=SecretOut, summary="Read a secret (not its value)"
)
def read(secret_name: SecretName, auth: TenantRead, session: DbSession) -> TenantSecret:
    return get_secret(session, auth, secret_name)


@router.delete(
    "/secrets/{secret_name}",
    status_code=204,
    summary="Delete a secret (409 `secret_in_use` while a workload that has not ended names it)",
)
def delete(secret_name: SecretName, auth: TenantWrite, session: DbSession) -> None:
    delete_secret(session, auth, secret_name)
