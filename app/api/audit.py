"""The audit log: a tenant reads its own entries, operators read everyone's."""

from __future__ import annotations

import uuid

from fastapi import Depends, Query

from app.audit.schemas import AdminAuditEntryOut, AuditEntryOut
from app.audit.service import list_entries
from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams, QueryDatetime, text_query
from app.tenancy.auth import Platform, TenantRead

router = api_router(prefix="/v1", tags=["audit"])
admin = api_router(prefix="/v1/admin", tags=["admin: audit"])

SINCE = Query(None, alias="from", description="Entries at or after this instant")
UNTIL = Query(None, alias="to", description="Entries before this instant")
ACTION = text_query(max_length=120, description='e.g. "DELETE /v1/workloads/{workload_id}"')
TARGET_TYPE = text_query(max_length=32, description="e.g. workload")
TARGET_ID = text_query(description="The target's id")


@router.get("/audit", response_model=Page[AuditEntryOut], summary="The tenant's audit log")
def tenant_audit(
    *,
    since: QueryDatetime | None = SINCE,
    until: QueryDatetime | None = UNTIL,
    action: str | None = ACTION,
    target_type: str | None = TARGET_TYPE,
    target_id: str | None = TARGET_ID,
    page: PageParams = Depends(),
    auth: TenantRead,
    session: DbSession,
) -> dict:
    items, nxt = list_entries(
        session,
        auth,
        page,
        since=since,
        until=until,
        action=action,
        target_type=target_type,
        target_id=target_id,
    )
    # Operators acting on the tenant are named as operators, not by their keys.
    out = [
        AuditEntryOut.model_validate(e).model_copy(update={"key_id": None, "key_prefix": None})
        if e.principal == "operator"
        else e
        for e in items
    ]
    return {"items": out, "next_cursor": nxt}


@admin.get("/audit", response_model=Page[AdminAuditEntryOut], summary="Everyone's audit log")
def admin_audit(
    *,
    since: QueryDatetime | None = SINCE,
    until: QueryDatetime | None = UNTIL,
    action: str | None = ACTION,
    target_type: str | None = TARGET_TYPE,
    target_id: str | None = TARGET_ID,
    tenant_id: uuid.UUID | None = None,
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = list_entries(
        session,
        auth,
        page,
        since=since,
        until=until,
        action=action,
        target_type=target_type,
        target_id=target_id,
        tenant_id=tenant_id,
    )
    return {"items": items, "next_cursor": nxt}
