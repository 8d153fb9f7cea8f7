"""Billing: a month's bill and the upcoming one, the budget, commitments, the price book and
(operators) the reconciliation with what Stripe was sent; and setting or removing a budget and
adding a price version. The same service calls as REST's billing and admin routes."""

from __future__ import annotations

import re

import strawberry

from app.billing import budgets, commitments, stripe_export
from app.billing import service as billing_service
from app.billing.schemas import (
    BillingSummary,
    BudgetIn,
    BudgetOut,
    CommitmentList,
    CommitmentOut,
    PriceIn,
    PriceList,
    PriceOut,
    Reconciliation,
)
from app.core.errors import NotFound, ValidationFailed
from app.core.schemas import PERIOD_PATTERN
from app.graphql.context import Info
from app.graphql.permissions import IsOperator, ReadsPrices, TenantRead
from app.graphql.results import Done, result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.models.tenants import Tenant
from app.tenancy.principal import require_platform, require_tenant_scope
from app.tenancy.scoping import get_owned

Bill = view(BillingSummary, "Bill", "A month's bill: line items and totals per currency")
BudgetView = view(BudgetOut, "Budget")
CommitmentView = view(CommitmentOut, "Commitment", "Reserved capacity for a term")
PriceView = view(PriceOut, "Price", "A price version: minor units per GPU-hour")
ReconciliationView = view(Reconciliation, "Reconciliation")
BudgetInput = input_view(BudgetIn, "BudgetInput")
PriceInput = input_view(PriceIn, "PriceInput")
BudgetResult = result_union("BudgetResult", BudgetView)
DoneResult = result_union("DoneResult", Done)
PriceResult = result_union("PriceResult", PriceView)


def _month(period: str) -> str:
    if not re.fullmatch(PERIOD_PATTERN, period):
        raise ValidationFailed("period is a month: YYYY-MM.", code="validation_error")
    return period


@strawberry.type
class BillingQuery:
    @strawberry.field(description="Your bill for a month (YYYY-MM), line items per SKU")
    def bill(self, info: Info, period: str) -> Bill:  # type: ignore[valid-type]
        auth = info.context.auth
        require_tenant_scope(auth, "read")
        month = _month(period)
        return shape(BillingSummary, billing_service.bill(info.context.session, auth, month))

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
        permission_classes=[IsOperator],
        description="Operators: ledger against what Stripe was sent, per tenant",
    )
    def reconciliation(self, info: Info, period: str) -> ReconciliationView:  # type: ignore[valid-type]
        auth = info.context.auth
        month = _month(period)
        return shape(Reconciliation, stripe_export.reconcile(info.context.session, auth, month))


@strawberry.type
class BillingMutation:
    @strawberry.mutation(description="Set your monthly budget (spend and/or GPU-hours)")
    def set_budget(self, info: Info, input: BudgetInput) -> BudgetResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(BudgetIn, input)
            tenant = get_owned(ctx.session, ctx.auth, Tenant, ctx.auth.tenant_id, what="tenant")
            budgets.set_budget(ctx.session, tenant.id, **body.model_dump())
            out = budgets.view(ctx.session, ctx.auth, tenant.id)
            return {"body": body}, out, shape(BudgetOut, out)

        return run_mutation(info, "setBudget", act)

    @strawberry.mutation(description="Remove your budget (no limits)")
    def remove_budget(self, info: Info) -> DoneResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            budgets.remove(ctx.session, ctx.auth)
            return {}, None, Done()

        return run_mutation(info, "removeBudget", act)

    @strawberry.mutation(
        description="Operators: add a price version, effective from its date (earlier versions "
        "stay). REST: POST /v1/admin/prices"
    )
    def create_price(self, info: Info, input: PriceInput) -> PriceResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(PriceIn, input)
            price = billing_service.create_price(ctx.session, **body.model_dump())
            return {"body": body}, price, shape(PriceOut, price)

        return run_mutation(info, "createPrice", act)
