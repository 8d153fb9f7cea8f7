"""The price book (operators write it, everyone reads it) and tenants' bills."""

from __future__ import annotations

from typing import Literal

from fastapi import Depends, Query
from fastapi.responses import StreamingResponse

from app.billing import budgets, commitments, exports, service, stripe_export
from app.billing.schemas import (
    BillingSummary,
    BudgetIn,
    BudgetOut,
    CommitmentIn,
    CommitmentList,
    CommitmentOut,
    PriceIn,
    PriceList,
    PriceOut,
    Reconciliation,
)
from app.core.errors import NotFound
from app.core.routing import DbSession, alias, api_router
from app.core.schemas import PERIOD_PATTERN
from app.models.billing import Commitment, Price
from app.models.tenants import Tenant
from app.tenancy.auth import AnyReader, Platform, TenantRead, TenantWrite, platform
from app.tenancy.scoping import get_owned

router = api_router(prefix="/v1", tags=["billing"])
PERIOD = Query(..., pattern=PERIOD_PATTERN, description="The month (UTC), e.g. 2026-11")
admin = api_router(prefix="/v1/admin", tags=["admin: billing"])
# The old operators' URL of a merged route answers operators only, as it did.
OPERATORS = [Depends(platform)]


@router.get(
    "/prices",
    response_model=PriceList,
    summary="The price book, every version (tenants and operators alike)",
)
def prices(auth: AnyReader, session: DbSession) -> dict:
    return service.price_book(session)


alias(
    admin, "GET", "/prices", prices, "/v1/prices", response_model=PriceList, dependencies=OPERATORS
)


@admin.post(
    "/prices",
    status_code=201,
    response_model=PriceOut,
    summary="Add a price version (effective from a date; earlier versions stay)",
)
def add_price(body: PriceIn, auth: Platform, session: DbSession) -> Price:
    return service.create_price(session, **body.model_dump())


@router.get(
    "/billing/summary",
    response_model=BillingSummary,
    summary="Your bill for a month: line items per SKU, tier, region, plan and price version",
)
def summary(*, period: str = PERIOD, auth: TenantRead, session: DbSession) -> dict:
    return service.bill(session, auth, period)


@router.get(
    "/billing/upcoming",
    response_model=BillingSummary,
    summary="Upcoming invoice preview: this month so far, running work accrued up to now",
)
def upcoming(auth: TenantRead, session: DbSession) -> dict:
    return service.upcoming_bill(session, auth)


@router.get("/budget", response_model=BudgetOut, summary="Your budget, this month's use and alerts")
def my_budget(auth: TenantRead, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, auth.tenant_id, what="tenant")
    return budgets.view(session, auth, tenant.id)


@router.put(
    "/budget",
    response_model=BudgetOut,
    summary="Set your monthly budget (spend and/or GPU-hour limit); evaluated at once",
)
def put_my_budget(body: BudgetIn, auth: TenantWrite, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, auth.tenant_id, what="tenant")
    budgets.set_budget(session, tenant.id, **body.model_dump())
    return budgets.view(session, auth, tenant.id)


@router.delete("/budget", status_code=204, summary="Remove your budget (no limits)")
def delete_my_budget(auth: TenantWrite, session: DbSession) -> None:
    budgets.remove(session, auth)


@admin.get(
    "/tenants/{tenant_id}/budget", response_model=BudgetOut, summary="A tenant's budget and use"
)
def tenant_budget(tenant_id: str, auth: Platform, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    return budgets.view(session, auth, tenant.id)


@admin.put(
    "/tenants/{tenant_id}/budget",
    response_model=BudgetOut,
    summary="Set a tenant's monthly budget; evaluated at once",
)
def put_tenant_budget(tenant_id: str, body: BudgetIn, auth: Platform, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    budgets.set_budget(session, tenant.id, **body.model_dump())
    return budgets.view(session, auth, tenant.id)


_EXPORT_MEDIA = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson"}
_EXPORT_DOC = {
    200: {
        "description": "One row per day, tenant, SKU, tier, region, plan and price version",
        "content": {"text/csv": {}, "application/x-ndjson": {}},
    }
}


@router.get(
    "/billing/exports",
    response_class=StreamingResponse,
    responses=_EXPORT_DOC,
    summary="A month as rows for finance (CSV or JSON lines), streamed: a tenant's own, "
    "or (operators) every tenant's",
)
def export(
    *,
    period: str = PERIOD,
    format: Literal["csv", "jsonl"] = Query("csv"),
    auth: AnyReader,
    session: DbSession,
) -> StreamingResponse:
    rows = exports.export_rows(session, auth, period)
    return StreamingResponse(
        exports.stream(rows, format),
        media_type=_EXPORT_MEDIA[format],
        headers={
            "Content-Disposition": f'attachment; filename="rackplane-usage-{period}.{format}"',
            "X-Row-Count": str(len(rows)),
        },
    )


alias(
    admin,
    "GET",
    "/billing/exports",
    export,
    "/v1/billing/exports",
    response_class=StreamingResponse,
    dependencies=OPERATORS,
)


@admin.get(
    "/billing/reconciliation",
    response_model=Reconciliation,
    summary="Ledger totals against what Stripe was sent, per tenant, meter and month",
)
def reconciliation(*, period: str = PERIOD, auth: Platform, session: DbSession) -> dict:
    return stripe_export.reconcile(session, auth, period)


@router.get(
    "/commitments",
    response_model=CommitmentList,
    summary="Your reserved capacity: usage up to it is priced at the reserved price",
)
def my_commitments(auth: TenantRead, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, auth.tenant_id, what="tenant")
    return commitments.of_tenant(session, auth, tenant.id)


@admin.get(
    "/tenants/{tenant_id}/commitments",
    response_model=CommitmentList,
    summary="A tenant's commitments (reserved capacity)",
)
def tenant_commitments(tenant_id: str, auth: Platform, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    return commitments.of_tenant(session, auth, tenant.id)


@admin.post(
    "/tenants/{tenant_id}/commitments",
    status_code=201,
    response_model=CommitmentOut,
    summary="Reserve capacity for a tenant: GPUs of a model (and region) for every hour of a term",
)
def add_commitment(
    tenant_id: str, body: CommitmentIn, auth: Platform, session: DbSession
) -> Commitment:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    commitments.check_region(session, body.region)
    fields = body.model_dump(exclude={"gpus"})
    return commitments.create(session, tenant.id, gpus_milli=body.gpus * 1000, **fields)


@admin.delete(
    "/tenants/{tenant_id}/commitments/{commitment_id}",
    status_code=204,
    summary="Withdraw a commitment whose term has not begun (409 once it has)",
)
def delete_commitment(
    tenant_id: str, commitment_id: str, auth: Platform, session: DbSession
) -> None:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    c = get_owned(session, auth, Commitment, commitment_id, what="commitment", for_update=True)
    if c.tenant_id != tenant.id:
        raise NotFound(f"No commitment with id {c.id}.", code="commitment_not_found")
    commitments.cancel(session, c)
