"""The customer's account: keys, quotas, capacity, usage, bills, budget, commitments, prices and
what-if placement. Each field is a REST route's service call under the same scope check, its
answer shaped by the same response model (app/graphql/views.py)."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Annotated, Any

import strawberry

from app.billing import budgets, commitments
from app.billing import service as billing_service
from app.billing.schemas import (
    BillingSummary,
    BudgetOut,
    CommitmentList,
    CommitmentOut,
    PriceList,
    PriceOut,
)
from app.core.errors import NotFound, ValidationFailed
from app.core.schemas import PERIOD_PATTERN, PageParams, paginate
from app.fleet import service as fleet_service
from app.fleet.schemas import Capacity, CapacityRow
from app.graphql.context import Context
from app.graphql.permissions import ReadsPrices, TenantRead
from app.graphql.types import Connection, connection
from app.graphql.views import input_view, parse, shape, view
from app.keys.schemas import KeyOut
from app.metering import service as metering_service
from app.metering.schemas import UsageOut
from app.models.keys import ApiKey as Row
from app.tenancy.auth import AuthContext, require_tenant_scope
from app.tenancy.scoping import scoped_select
from app.workloads import service as workloads_service
from app.workloads.schemas import DryRunOut, QuotaList, QuotaOut, WorkloadCreate

Info = strawberry.Info[Context, None]
MAX_PAGE = 500  # as REST's limit

ApiKey = view(KeyOut, "ApiKey", "An API key (its secret is shown only when it is created)")
Quota = view(QuotaOut, "Quota", "A quota per GPU model and what the tenant holds and queues")
CapacityRowView = view(CapacityRow, "CapacityRow")
UsageView = view(UsageOut, "Usage", "GPU-time used, by time bucket and the asked dimensions")
Bill = view(BillingSummary, "Bill", "A month's bill: line items and totals per currency")
BudgetView = view(BudgetOut, "Budget")
CommitmentView = view(CommitmentOut, "Commitment", "Reserved capacity for a term")
PriceView = view(PriceOut, "Price", "A price version: minor units per GPU-hour")
DryRun = view(DryRunOut, "DryRun", "Where a workload would land now, whom it would preempt")
WorkloadInput = input_view(WorkloadCreate, "WorkloadInput")


@strawberry.enum(description="Usage time buckets")
class Granularity(Enum):
    HOUR = "hour"
    DAY = "day"


@strawberry.enum(description="What usage can be grouped by (the ledger's dimensions)")
class UsageDimension(Enum):
    TENANT_ID = "tenant_id"
    WORKLOAD_ID = "workload_id"
    REGION = "region"
    GPU_MODEL = "gpu_model"
    SHAPE = "shape"
    TIER = "tier"
    PRIORITY = "priority"


def page_params(first: int, after: str | None) -> PageParams:
    if not 1 <= first <= MAX_PAGE:
        raise ValidationFailed(f"first is 1 to {MAX_PAGE}.", code="validation_error")
    return PageParams(limit=first, cursor=after)


def reader(auth: AuthContext) -> None:
    """A tenant key with `read`, or an operator's (fields both may read: prices, capacity)."""
    if not auth.is_platform:
        require_tenant_scope(auth, "read")


def aware(name: str, value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValidationFailed(f"{name} needs a UTC offset (RFC 3339).", code="validation_error")
    return value


@strawberry.type
class AccountQuery:
    @strawberry.field(
        permission_classes=[TenantRead], description="Your API keys (REST: GET /v1/keys)"
    )
    def api_keys(self, info: Info, first: int = 50, after: str | None = None) -> Connection[ApiKey]:  # type: ignore[valid-type]
        auth = info.context.auth
        rows, nxt = paginate(
            info.context.session, scoped_select(auth, Row), Row, page_params(first, after)
        )
        return connection(rows, lambda r: shape(KeyOut, r), nxt)

    @strawberry.field(
        permission_classes=[TenantRead],
        description="Your quotas per GPU model with what you hold and queue",
    )
    def quotas(self, info: Info) -> list[Quota]:  # type: ignore[valid-type]
        auth = info.context.auth
        return shape(
            QuotaList, workloads_service.quota_list(info.context.session, auth.tenant_id)
        ).items

    @strawberry.field(
        permission_classes=[ReadsPrices],
        description="Free capacity by region and GPU model: whole GPUs, milli-GPU, MIG slices",
    )
    def capacity(self, info: Info) -> list[CapacityRowView]:  # type: ignore[valid-type]
        return shape(Capacity, {"items": fleet_service.capacity(info.context.session)}).items

    @strawberry.field(description="Your usage by time bucket, grouped by ledger dimensions")
    def usage(
        self,
        info: Info,
        from_: Annotated[datetime, strawberry.argument(name="from")],
        to: datetime,
        granularity: Granularity = Granularity.DAY,
        group_by: list[UsageDimension] | None = None,
    ) -> UsageView:  # type: ignore[valid-type]
        auth = info.context.auth
        reader(auth)
        groups = [g.value for g in group_by or []]
        report = metering_service.usage_report(
            info.context.session,
            metering_service.visible_to(auth),
            aware("from", from_),
            aware("to", to),
            granularity.value,
            groups,
        )
        return shape(UsageOut, report)

    @strawberry.field(description="Your bill for a month (YYYY-MM), line items per SKU")
    def bill(self, info: Info, period: str) -> Bill:  # type: ignore[valid-type]
        import re

        auth = info.context.auth
        require_tenant_scope(auth, "read")
        if not re.fullmatch(PERIOD_PATTERN, period):
            raise ValidationFailed("period is a month: YYYY-MM.", code="validation_error")
        return shape(BillingSummary, billing_service.bill(info.context.session, auth, period))

    @strawberry.field(
        permission_classes=[TenantRead],
        description="This month so far: the upcoming invoice, running work accrued",
    )
    def upcoming_bill(self, info: Info) -> Bill:  # type: ignore[valid-type]
        auth = info.context.auth
        return shape(BillingSummary, billing_service.upcoming_bill(info.context.session, auth))

    @strawberry.field(
        permission_classes=[TenantRead],
        description="Your budget, this month's use and alerts; null without one",
    )
    def budget(self, info: Info) -> BudgetView | None:  # type: ignore[valid-type]
        auth = info.context.auth
        try:
            return shape(BudgetOut, budgets.view(info.context.session, auth, auth.tenant_id))
        except NotFound:
            return None

    @strawberry.field(
        permission_classes=[TenantRead], description="Your reserved capacity (commitments)"
    )
    def commitments(self, info: Info) -> list[CommitmentView]:  # type: ignore[valid-type]
        auth = info.context.auth
        got = commitments.of_tenant(info.context.session, auth, auth.tenant_id)
        return shape(CommitmentList, got).items

    @strawberry.field(permission_classes=[ReadsPrices], description="The price book, every version")
    def prices(self, info: Info) -> list[PriceView]:  # type: ignore[valid-type]
        return shape(PriceList, billing_service.price_book(info.context.session)).items

    @strawberry.field(
        permission_classes=[TenantRead],
        description="What-if: where a workload would land now, whom it would preempt, or when "
        "it would start (REST: POST /v1/workloads:dry-run)",
    )
    def dry_run(self, info: Info, input: WorkloadInput) -> DryRun:  # type: ignore[valid-type]
        auth = info.context.auth
        body = parse_or_fail(WorkloadCreate, input)
        return shape(DryRunOut, workloads_service.dry_run(info.context.session, auth, body))


def parse_or_fail(model: Any, value: Any) -> Any:
    """For a query (no result union): invalid input is a ValidationFailed with field paths."""
    from pydantic import ValidationError

    from app.graphql.views import camel

    try:
        return parse(model, value)
    except ValidationError as e:
        fields = [
            {
                "path": [
                    "input",
                    *[camel(p) if isinstance(p, str) else str(p) for p in err["loc"]],
                ],
                "message": err["msg"],
            }
            for err in e.errors()
        ]
        raise ValidationFailed(
            "; ".join(f"{'.'.join(f['path'])}: {f['message']}" for f in fields),
            code="validation_error",
            fields=fields,
        ) from None
