"""Tenants: the calling tenant (`viewer`), and for operators every tenant, approving,
suspending, reactivating and updating one. The same service calls as REST's admin tenant
routes, refused to tenant keys by the same check (`require_platform`)."""

from __future__ import annotations

from collections.abc import Callable

import strawberry

from app.core.errors import NotFound, ValidationFailed
from app.graphql.context import Context, Info
from app.graphql.pagination import Connection, connection, page_params
from app.graphql.permissions import IsOperator, TenantReadAnyStatus
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.models.tenants import Tenant, TenantStatus
from app.tenancy.principal import require_platform
from app.tenancy.scoping import get_owned
from app.tenants import service as tenants
from app.tenants.schemas import TenantOut, TenantUpdate

TenantView = view(TenantOut, "Tenant", "A tenant: status, isolation policy, billing link")
TenantUpdateInput = input_view(TenantUpdate, "TenantUpdateInput")
TenantResult = result_union("TenantResult", TenantView)


@strawberry.type(description="The calling tenant")
class Viewer:
    id: strawberry.ID
    slug: str
    name: str
    status: str
    isolation_policy: list[str]


def _tenant(ctx: Context, id: strawberry.ID) -> Tenant:
    return get_owned(ctx.session, ctx.auth, Tenant, str(id), what="tenant")


def _change_status(
    info: Info, id: strawberry.ID, name: str, change: Callable[[Tenant], Tenant]
) -> TenantResult:  # type: ignore[valid-type]
    """An operator's move of a tenant from one status to the next (approve, suspend,
    reactivate): `change` on the tenant, one audit entry."""

    def act():
        ctx = info.context
        require_platform(ctx.auth)
        tenant = change(_tenant(ctx, id))
        return {"tenant_id": str(id)}, tenant, shape(TenantOut, tenant)

    return run_mutation(info, name, act)


@strawberry.type
class TenantQuery:
    @strawberry.field(permission_classes=[TenantReadAnyStatus], description="The calling tenant")
    def viewer(self, info: Info) -> Viewer:
        auth = info.context.auth
        t = info.context.session.get(Tenant, auth.tenant_id)
        if t is None:
            raise NotFound("The key's tenant is gone.")
        return Viewer(
            id=strawberry.ID(str(t.id)),
            slug=t.slug,
            name=t.name,
            status=t.status,
            isolation_policy=list(t.isolation_policy or []),
        )

    @strawberry.field(permission_classes=[IsOperator], description="Operators: tenants, by status")
    def tenants(
        self,
        info: Info,
        first: int = 50,
        after: str | None = None,
        status: str | None = None,
    ) -> Connection[TenantView]:  # type: ignore[valid-type]
        auth = info.context.auth
        try:
            st = TenantStatus(status) if status is not None else None
        except ValueError:
            raise ValidationFailed(
                f"No tenant status {status!r}.", code="validation_error"
            ) from None
        rows, nxt = tenants.list_tenants(
            info.context.session, auth, page_params(first, after), status=st
        )
        return connection(rows, lambda t: shape(TenantOut, t), nxt)

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: a tenant (REST: GET /v1/admin/tenants/{id})",
    )
    def tenant(self, info: Info, id: strawberry.ID) -> TenantView:  # type: ignore[valid-type]
        return shape(TenantOut, _tenant(info.context, id))


@strawberry.type
class TenantMutation:
    @strawberry.mutation(description="Operators: approve a pending (self-service) tenant")
    def approve_tenant(self, info: Info, id: strawberry.ID) -> TenantResult:  # type: ignore[valid-type]
        return _change_status(info, id, "approveTenant", tenants.approve)

    @strawberry.mutation(
        description="Operators: suspend an active tenant: from its next request, its keys may "
        "only read the tenant itself (`viewer`; everything else is refused with "
        "tenant_not_active, as for a pending tenant); its queued and running workloads carry "
        "on. REST: POST /v1/admin/tenants/{id}:suspend"
    )
    def suspend_tenant(self, info: Info, id: strawberry.ID) -> TenantResult:  # type: ignore[valid-type]
        return _change_status(info, id, "suspendTenant", tenants.suspend)

    @strawberry.mutation(
        description="Operators: reactivate a suspended tenant: its keys work again. "
        "REST: POST /v1/admin/tenants/{id}:reactivate"
    )
    def reactivate_tenant(self, info: Info, id: strawberry.ID) -> TenantResult:  # type: ignore[valid-type]
        return _change_status(info, id, "reactivateTenant", tenants.reactivate)

    @strawberry.mutation(
        description="Operators: change a tenant's name, contact, isolation policy or status "
        "(the fields given). REST: PATCH /v1/admin/tenants/{id}"
    )
    def update_tenant(
        self,
        info: Info,
        id: strawberry.ID,
        input: TenantUpdateInput,  # type: ignore[valid-type]
    ) -> TenantResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(TenantUpdate, input)
            tenant = tenants.update_tenant(ctx.session, _tenant(ctx, id), body)
            return {"tenant_id": str(id), "body": body}, tenant, shape(TenantOut, tenant)

        return run_mutation(info, "updateTenant", act)
