"""The audit log: a tenant reads its own entries, operators read everyone's."""

from __future__ import annotations

import uuid
from datetime import datetime

from fastapi import Depends, Query
from sqlalchemy import Select
from sqlalchemy.orm import Session

from app.audit.schemas import AdminAuditEntryOut, AuditEntryOut
from app.core.db import session_dependency
from app.core.routing import api_router
from app.core.schemas import Page, PageParams, QueryDatetime, paginate, text_query
from app.models.audit import AuditEntry
from app.tenancy.auth import AuthContext, platform, tenant_read
from app.tenancy.scoping import scoped_select

router = api_router(prefix="/v1", tags=["audit"])
admin = api_router(prefix="/v1/admin", tags=["admin: audit"])

SINCE = Query(None, alias="from", description="Entries at or after this instant")
UNTIL = Query(None, alias="to", description="Entries before this instant")
ACTION = text_query(max_length=120, description='e.g. "DELETE /v1/workloads/{workload_id}"')
TARGET_TYPE = text_query(max_length=32, description="e.g. workload")
TARGET_ID = text_query(description="The target's id")


def _filtered(
    stmt: Select,
    since: datetime | None,
    until: datetime | None,
    action: str | None,
    target_type: str | None,
    target_id: str | None,
) -> Select:
    if since is not None:
        stmt = stmt.where(AuditEntry.created_at >= since)
    if until is not None:
        stmt = stmt.where(AuditEntry.created_at < until)
    for column, value in (
        (AuditEntry.action, action),
        (AuditEntry.target_type, target_type),
        (AuditEntry.target_id, target_id),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    return stmt


@router.get("/audit", response_model=Page[AuditEntryOut], summary="The tenant's audit log")
def tenant_audit(
    since: QueryDatetime | None = SINCE,
    until: QueryDatetime | None = UNTIL,
    action: str | None = ACTION,
    target_type: str | None = TARGET_TYPE,
    target_id: str | None = TARGET_ID,
    page: PageParams = Depends(),
    auth: AuthContext = Depends(tenant_read),
    session: Session = Depends(session_dependency),
) -> dict:
    stmt = _filtered(scoped_select(auth, AuditEntry), since, until, action, target_type, target_id)
    items, nxt = paginate(session, stmt, AuditEntry, page)
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
    since: QueryDatetime | None = SINCE,
    until: QueryDatetime | None = UNTIL,
    action: str | None = ACTION,
    target_type: str | None = TARGET_TYPE,
    target_id: str | None = TARGET_ID,
    tenant_id: uuid.UUID | None = None,
    page: PageParams = Depends(),
    auth: AuthContext = Depends(platform),
    session: Session = Depends(session_dependency),
) -> dict:
    stmt = _filtered(scoped_select(auth, AuditEntry), since, until, action, target_type, target_id)
    if tenant_id is not None:
        stmt = stmt.where(AuditEntry.tenant_id == tenant_id)
    items, nxt = paginate(session, stmt, AuditEntry, page)
    return {"items": items, "next_cursor": nxt}
