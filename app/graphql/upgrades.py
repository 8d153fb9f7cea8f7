"""Rolling upgrades for operators: the same service functions as `/v1/admin/upgrades`."""

from __future__ import annotations

import strawberry

from app.fleet import upgrades as service
from app.fleet.schemas import UpgradeCreate, UpgradeList, UpgradeOut
from app.graphql.context import Info
from app.graphql.permissions import IsOperator
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.tenancy.principal import require_platform

UpgradeView = view(UpgradeOut, "Upgrade", "A rolling upgrade: its progress and report")
UpgradeInput = input_view(UpgradeCreate, "UpgradeInput")
UpgradeResult = result_union("UpgradeResult", UpgradeView)


@strawberry.type
class UpgradeQuery:
    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: rolling upgrades, newest first (REST: GET /v1/admin/upgrades)",
    )
    def upgrades(self, info: Info) -> list[UpgradeView]:  # type: ignore[valid-type]
        return shape(UpgradeList, service.list_all(info.context.session)).items

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: an upgrade's progress and report, node by node "
        "(REST: GET /v1/admin/upgrades/{id})",
    )
    def upgrade(self, info: Info, id: strawberry.ID) -> UpgradeView:  # type: ignore[valid-type]
        session = info.context.session
        return shape(UpgradeOut, service.describe(session, service.get(session, str(id))))


@strawberry.type
class UpgradeMutation:
    @strawberry.mutation(
        description="Operators: start a rolling upgrade of a region's or pool's nodes to a "
        "software stack (REST: POST /v1/admin/upgrades)"
    )
    def start_upgrade(self, info: Info, input: UpgradeInput) -> UpgradeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(UpgradeCreate, input)
            up = service.start(ctx.session, body, requested_by=f"key {ctx.auth.key_prefix}")
            out = service.describe(ctx.session, up)
            return {"body": body}, out, shape(UpgradeOut, out)

        return run_mutation(info, "startUpgrade", act)

    @strawberry.mutation(
        description="Operators: resume a paused upgrade; its failed nodes are tried again "
        "(REST: POST /v1/admin/upgrades/{id}/resume)"
    )
    def resume_upgrade(self, info: Info, id: strawberry.ID) -> UpgradeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            up = service.resume(ctx.session, service.get(ctx.session, str(id), lock=True))
            out = service.describe(ctx.session, up)
            return {"id": str(id)}, out, shape(UpgradeOut, out)

        return run_mutation(info, "resumeUpgrade", act)

    @strawberry.mutation(
        description="Operators: roll an upgrade back; every node it touched returns to the "
        "stack it ran before (REST: POST /v1/admin/upgrades/{id}/rollback)"
    )
    def rollback_upgrade(self, info: Info, id: strawberry.ID) -> UpgradeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            up = service.rollback(ctx.session, service.get(ctx.session, str(id), lock=True))
            out = service.describe(ctx.session, up)
            return {"id": str(id)}, out, shape(UpgradeOut, out)

        return run_mutation(info, "rollbackUpgrade", act)
