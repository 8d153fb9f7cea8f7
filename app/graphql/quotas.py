"""Quotas: the caller's GPU quotas with what it holds and queues, (operators) a tenant's, and
replacing a tenant's quotas. The same service calls as REST's quota routes."""

from __future__ import annotations

import strawberry

from app.graphql.context import Info
from app.graphql.permissions import IsOperator, TenantRead
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.models.tenants import Tenant
from app.tenancy.principal import require_platform
from app.tenancy.scoping import get_owned
from app.workloads.quotas import quota_list, set_quotas
from app.workloads.replies import QuotaList, QuotaOut
from app.workloads.schemas import QuotaSet

Quota = view(QuotaOut, "Quota", "A quota per GPU model and what the tenant holds and queues")
QuotaSetInput = input_view(QuotaSet, "QuotaSetInput")


@strawberry.type(description="A tenant's quotas, replaced")
class QuotaSetDone:
    tenant_id: strawberry.ID
    quotas: list[Quota]  # type: ignore[valid-type]


QuotaSetResult = result_union("QuotaSetResult", QuotaSetDone)


@strawberry.type
class QuotaQuery:
    @strawberry.field(
        permission_classes=[TenantRead],
        description="Your quotas per GPU model with what you hold and queue",
    )
    def quotas(self, info: Info) -> list[Quota]:  # type: ignore[valid-type]
        auth = info.context.auth
        return shape(QuotaList, quota_list(info.context.session, auth.tenant_id)).items

    @strawberry.field(
        permission_classes=[IsOperator], description="Operators: a tenant's quotas and use"
    )
    def tenant_quotas(self, info: Info, tenant_id: strawberry.ID) -> list[Quota]:  # type: ignore[valid-type]
        auth = info.context.auth
        tenant = get_owned(info.context.session, auth, Tenant, str(tenant_id), what="tenant")
        return shape(QuotaList, quota_list(info.context.session, tenant.id)).items


@strawberry.type
class QuotaMutation:
    @strawberry.mutation(description="Operators: replace a tenant's quotas")
    def set_tenant_quotas(
        self,
        info: Info,
        tenant_id: strawberry.ID,
        input: QuotaSetInput,  # type: ignore[valid-type]
    ) -> QuotaSetResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(QuotaSet, input)
            tenant = get_owned(ctx.session, ctx.auth, Tenant, str(tenant_id), what="tenant")
            set_quotas(ctx.session, tenant.id, body.quotas)
            ctx.session.flush()
            quotas = shape(QuotaList, quota_list(ctx.session, tenant.id)).items
            done = QuotaSetDone(tenant_id=strawberry.ID(str(tenant.id)), quotas=quotas)
            return {"tenant_id": str(tenant.id), "body": body}, None, done

        return run_mutation(info, "setTenantQuotas", act)
