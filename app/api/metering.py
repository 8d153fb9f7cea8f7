"""Usage for tenants (their own only) and operators (any tenant, and the fleet's idle iron)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Query

from app.core.errors import ValidationFailed
from app.core.routing import DbSession, alias, api_router
from app.core.schemas import QueryDatetime
from app.health import idle
from app.health.schemas import IdleTimeOut
from app.metering import service
from app.metering.schemas import (
    IngestOut,
    UsageEventBatch,
    UsageOut,
    UtilisationOut,
)
from app.tenancy.auth import AnyReader, Platform, platform

router = api_router(prefix="/v1", tags=["usage"])
admin = api_router(prefix="/v1/admin", tags=["admin: usage"])

# The Query inside Annotated: FastAPI keeps the RFC 3339 check only that way for a required
# parameter (with `= Query(...)` as the default it dropped the BeforeValidator).
From = Annotated[
    QueryDatetime,
    Query(alias="from", description="Window start (inclusive), ISO 8601 with offset"),
]
To = Annotated[QueryDatetime, Query(alias="to", description="Window end (exclusive)")]
GRANULARITY = Query("day", pattern="^(hour|day)$")
GROUP_BY = Query(
    "",
    max_length=200,
    pattern=r"^([a-z_]+(,[a-z_]+)*)?$",
    description="Comma-separated dimensions: "
    + ", ".join(service.DIMENSIONS)
    + ". Empty: one total per bucket.",
)


def _group_by(raw: str) -> list[str]:
    return [g.strip() for g in raw.split(",") if g.strip()]


@router.get(
    "/usage",
    response_model=UsageOut,
    summary="Usage by time bucket and dimension: a tenant's own, or (operators) any tenant's "
    "or everyone's",
)
def usage(
    *,
    start: From,
    end: To,
    granularity: str = GRANULARITY,
    group_by: str = GROUP_BY,
    tenant_id: uuid.UUID | None = Query(
        None,
        description="Only this tenant's usage. Operators name any tenant (none: everyone); a "
        "tenant sees its own only, whichever it names.",
    ),
    auth: AnyReader,
    session: DbSession,
) -> dict:
    groups = _group_by(group_by)
    scope = service.visible_to(auth, tenant_id)
    return service.usage_report(session, scope, start, end, granularity, groups)


alias(
    admin,
    "GET",
    "/usage",
    usage,
    "/v1/usage",
    response_model=UsageOut,
    dependencies=[Depends(platform)],  # the operators' URL: operators only, as before
)


@admin.get(
    "/utilisation",
    response_model=UtilisationOut,
    summary="Fleet utilisation: allocated vs idle GPU-hours by region and GPU model",
)
def utilisation(
    *, start: From, end: To, granularity: str = GRANULARITY, auth: Platform, session: DbSession
) -> dict:
    return service.utilisation_report(session, service.visible_to(auth), start, end, granularity)


@admin.get(
    "/idle-time",
    response_model=IdleTimeOut,
    summary="Idle GPU-hours by cause (no demand, stranded, unhealthy, cordoned) over time",
)
def idle_time(
    *, start: From, end: To, granularity: str = GRANULARITY, auth: Platform, session: DbSession
) -> dict:
    return idle.report(session, start, end, granularity)


@admin.post(
    "/usage/events",
    response_model=IngestOut,
    summary="Ingest usage events (providers, replays, corrections); repeats are skipped",
)
def ingest(body: UsageEventBatch, auth: Platform, session: DbSession) -> dict:
    unknown = service.unknown_tenants(session, {e.tenant_id for e in body.events})
    if unknown:
        raise ValidationFailed(
            f"Unknown tenant(s): {', '.join(sorted(map(str, unknown)))}.", code="unknown_tenant"
        )
    new = service.ingest(session, (e.model_dump() for e in body.events))
    return {"received": len(body.events), "new": new}
