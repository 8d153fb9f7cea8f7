"""Fleet health, for operators: the fleet's health, incidents and breaker, idle GPU-hours by
cause; and quarantining, releasing or retiring a node or one GPU by hand. The same service
calls as REST's admin health routes, refused to tenant keys by the same check."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import strawberry
from sqlalchemy import select

from app.core.db import get_or_404, utcnow
from app.core.errors import NotFound
from app.graphql.arguments import Granularity, aware, node_id
from app.graphql.context import Context, Info
from app.graphql.permissions import IsOperator
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.health import burnin, idle
from app.health import operators as health_operators
from app.health import views as health_views
from app.health.schemas import BringUp, FleetHealth, HealthActionIn, HealthActionOut, IdleTimeOut
from app.models.fleet import Gpu as GpuRow
from app.models.fleet import Node as NodeRow
from app.tenancy.principal import require_platform

FleetHealthView = view(FleetHealth, "FleetHealth")
BringUpView = view(BringUp, "BringUp", "Nodes on their way into service, and why any is stuck")
IdleTimeView = view(IdleTimeOut, "IdleTime", "Idle GPU-hours by cause over time")
HealthActionInput = input_view(HealthActionIn, "HealthActionInput")
HealthActionView = view(HealthActionOut, "HealthAction", "A node's or GPU's health after an action")
HealthActionResult = result_union("HealthActionResult", HealthActionView)


def _gpu(ctx: Context, node: strawberry.ID, index: int) -> tuple[GpuRow, NodeRow]:
    """A node's GPU by its index, and its node, both locked (in REST's order: the GPU, then
    its node). 404s: node_not_found, gpu_not_found."""
    nid = node_id(str(node))
    gpu = (
        ctx.session.scalar(
            select(GpuRow).where(GpuRow.node_id == nid, GpuRow.index == index).with_for_update()
        )
        if nid is not None
        else None
    )
    if gpu is None:
        get_or_404(ctx.session, NodeRow, str(node), what="node")
        raise NotFound(f"Node {node} has no GPU {index}.", code="gpu_not_found")
    return gpu, get_or_404(ctx.session, NodeRow, str(gpu.node_id), what="node", for_update=True)


@strawberry.type
class HealthQuery:
    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: idle GPU-hours by cause (no demand, stranded, unhealthy, "
        "cordoned) over time",
    )
    def idle_time(
        self,
        info: Info,
        from_: Annotated[datetime, strawberry.argument(name="from")],
        to: datetime,
        granularity: Granularity = Granularity.HOUR,
    ) -> IdleTimeView:  # type: ignore[valid-type]
        report = idle.report(
            info.context.session, aware("from", from_), aware("to", to), granularity.value
        )
        return shape(IdleTimeOut, report)

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: the fleet's health, incidents and breaker state",
    )
    def fleet_health(self, info: Info) -> FleetHealthView:  # type: ignore[valid-type]
        return shape(FleetHealth, health_views.summary(info.context.session))

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: nodes on their way into service (bring-up, after a repair, in "
        "an upgrade), their burn-in, and why any is stuck (REST: GET /v1/admin/bring-up)",
    )
    def bring_up(self, info: Info) -> BringUpView:  # type: ignore[valid-type]
        return shape(BringUp, burnin.bring_up(info.context.session, utcnow()))


@strawberry.type
class HealthMutation:
    @strawberry.mutation(
        description="Operators: quarantine, release or retire a whole node by hand "
        "(REST: POST /v1/admin/nodes/{id}/health)"
    )
    def set_node_health(
        self,
        info: Info,
        id: strawberry.ID,
        input: HealthActionInput,  # type: ignore[valid-type]
    ) -> HealthActionResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(HealthActionIn, input)
            node = get_or_404(ctx.session, NodeRow, str(id), what="node", for_update=True)
            done = health_operators.act(ctx.session, node, None, body.action, body.reason)
            return {"node_id": str(node.id), "body": body}, None, shape(HealthActionOut, done)

        return run_mutation(info, "setNodeHealth", act)

    @strawberry.mutation(
        description="Operators: quarantine, release (back to service, through validation if it "
        "was out of service) or retire one GPU of a node, by its index "
        "(REST: POST /v1/admin/gpus/{id}/health; CLI: rackplane fleet release NODE --gpu N)"
    )
    def set_gpu_health(
        self,
        info: Info,
        node_id: strawberry.ID,
        gpu_index: int,
        input: HealthActionInput,  # type: ignore[valid-type]
    ) -> HealthActionResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(HealthActionIn, input)
            gpu, node = _gpu(ctx, node_id, gpu_index)
            done = health_operators.act(ctx.session, node, gpu, body.action, body.reason)
            params = {"gpu_id": str(gpu.id), "node_id": str(node.id), "gpu_index": gpu.index}
            return {**params, "body": body}, None, shape(HealthActionOut, done)

        return run_mutation(info, "setGpuHealth", act)
