"""The operator's side (platform keys): regions, racks, tenants and their quotas, fleet
utilisation and health, imports, reconciliation, chaos experiments; and the mutations for node
state, GPU and node health (quarantine, release, retire), quotas, tenants (approve, suspend,
reactivate, update: isolation policy...), price versions and stopping a chaos experiment. The
same service calls as REST's admin routes, refused to tenant keys by the same check
(`require_platform`); each mutation is one audit entry (`_run`)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

import strawberry
from sqlalchemy import select

from app.billing import service as billing
from app.billing import stripe_export
from app.billing.schemas import PriceIn, PriceOut, Reconciliation
from app.chaos import service as chaos
from app.chaos.schemas import (
    ExperimentOut,
    ExperimentState,
    ExperimentSummaryOut,
    FaultReport,
    InjectionOut,
    Invariants,
)
from app.core.db import get_or_404
from app.core.errors import NotFound, ValidationFailed
from app.core.schemas import PERIOD_PATTERN
from app.fleet.fleetmap import fleet_map
from app.fleet.schemas import FleetImportOut, NodeStateChange, RackOut, RegionOut
from app.fleet.service import change_node_state, list_racks, list_regions
from app.graphql.account import Granularity, PriceView, Quota, aware, page_params
from app.graphql.context import Context
from app.graphql.mutations import _results, _run
from app.graphql.permissions import IsOperator
from app.graphql.types import Connection, Node, connection, node_id
from app.graphql.views import input_view, parse, shape, text_args, view
from app.health import idle
from app.health import service as health
from app.health.schemas import FleetHealth, HealthActionIn, HealthActionOut, IdleTimeOut
from app.metering import service as metering_service
from app.metering.schemas import UtilisationOut
from app.models.chaos import ChaosExperiment
from app.models.fleet import FleetImport
from app.models.fleet import Gpu as GpuRow
from app.models.fleet import Node as NodeRow
from app.models.fleet import Node as Row
from app.models.tenants import Tenant, TenantStatus
from app.tenancy.auth import require_platform
from app.tenancy.scoping import get_owned
from app.tenants import service as tenants
from app.tenants.schemas import TenantOut, TenantUpdate
from app.tenants.service import list_tenants
from app.workloads import service as workloads_service
from app.workloads.schemas import QuotaList, QuotaSet

Info = strawberry.Info[Context, None]

RegionView = view(RegionOut, "Region")
RackView = view(RackOut, "Rack")
TenantView = view(TenantOut, "Tenant", "A tenant: status, isolation policy, billing link")
UtilisationView = view(UtilisationOut, "Utilisation", "Allocated vs idle GPU-hours")
ReconciliationView = view(Reconciliation, "Reconciliation")
FleetImportView = view(FleetImportOut, "FleetImport")
FleetHealthView = view(FleetHealth, "FleetHealth")
IdleTimeView = view(IdleTimeOut, "IdleTime", "Idle GPU-hours by cause over time")
QuotaSetInput = input_view(QuotaSet, "QuotaSetInput")
NodeStateInput = input_view(NodeStateChange, "NodeStateInput")
TenantUpdateInput = input_view(TenantUpdate, "TenantUpdateInput")
PriceInput = input_view(PriceIn, "PriceInput")
HealthActionInput = input_view(HealthActionIn, "HealthActionInput")
HealthActionView = view(HealthActionOut, "HealthAction", "A node's or GPU's health after an action")
# The report's parts first, so their names say whose they are.
view(InjectionOut, "ChaosInjection", "A fault injected on a GPU (or node), and when undone")
view(FaultReport, "ChaosFaultReport", "Per fault: what the health loop did, and how fast")
view(Invariants, "ChaosInvariants", "What must never happen, counted over the experiment")
ChaosExperimentView = view(
    ExperimentOut, "ChaosExperiment", "A chaos experiment, its injections and its report"
)
ChaosExperimentSummaryView = view(
    ExperimentSummaryOut, "ChaosExperimentSummary", "A chaos experiment, without its report"
)


@strawberry.type(description="A rack on the map: its nodes are the next `nodes` of the map's")
class MapRack:
    name: str
    region: int = strawberry.field(description="Index into the map's `regions`")
    kind: str = strawberry.field(description="hgx, nvl72, ...: how the page draws it")
    block: str
    nodes: int


@strawberry.type(description="A GPU in MIG mode and the slices held on it")
class MapMig:
    gpu: int = strawberry.field(description="Index into the map's `gpus`")
    layout: str = strawberry.field(description="`profile@slot`, comma-separated; empty: none")


@strawberry.type(description="What a GPU cell's character means")
class MapState:
    code: str
    name: str
    description: str


@strawberry.type(
    description="The whole fleet as cells, in one answer: regions, racks in region order, "
    "their nodes in rack order, and one character per GPU in node order (see `legend`)"
)
class FleetMap:
    generated_at: datetime
    regions: list[str]
    racks: list[MapRack]
    models: list[str]
    nodes: list[str] = strawberry.field(description="Node names, in map order")
    node_states: str = strawberry.field(
        description="One character per node: r ready, c cordoned, d draining, x down, t retired"
    )
    node_models: list[int] = strawberry.field(description="Per node: index into `models`")
    gpu_counts: list[int] = strawberry.field(description="Per node: how many of `gpus` are its")
    gpus: str = strawberry.field(description="One character per GPU (see `legend`)")
    mig: list[MapMig]
    legend: list[MapState]


@strawberry.type(description="A tenant's quotas, replaced")
class QuotaSetDone:
    tenant_id: strawberry.ID
    quotas: list[Quota]  # type: ignore[valid-type]


@strawberry.type
class OperatorQuery:
    @strawberry.field(permission_classes=[IsOperator], description="Operators: regions")
    def regions(
        self, info: Info, first: int = 50, after: str | None = None
    ) -> Connection[RegionView]:  # type: ignore[valid-type]
        rows, nxt = list_regions(info.context.session, page_params(first, after))
        return connection(rows, lambda r: shape(RegionOut, r), nxt)

    @strawberry.field(
        permission_classes=[IsOperator], description="Operators: racks, in one region if asked"
    )
    def racks(
        self,
        info: Info,
        first: int = 50,
        after: str | None = None,
        region_id: strawberry.ID | None = None,
    ) -> Connection[RackView]:  # type: ignore[valid-type]
        rows, nxt = list_racks(
            info.context.session,
            page_params(first, after),
            region_id=str(region_id) if region_id else None,
        )
        return connection(rows, lambda r: shape(RackOut, r), nxt)

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
        rows, nxt = list_tenants(info.context.session, auth, page_params(first, after), status=st)
        return connection(rows, lambda t: shape(TenantOut, t), nxt)

    @strawberry.field(
        permission_classes=[IsOperator], description="Operators: a tenant's quotas and use"
    )
    def tenant_quotas(self, info: Info, tenant_id: strawberry.ID) -> list[Quota]:  # type: ignore[valid-type]
        auth = info.context.auth
        tenant = get_owned(info.context.session, auth, Tenant, str(tenant_id), what="tenant")
        return shape(QuotaList, workloads_service.quota_list(info.context.session, tenant.id)).items

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: allocated vs idle GPU-hours by region and model",
    )
    def utilisation(
        self,
        info: Info,
        from_: Annotated[datetime, strawberry.argument(name="from")],
        to: datetime,
        granularity: Granularity = Granularity.DAY,
    ) -> UtilisationView:  # type: ignore[valid-type]
        auth = info.context.auth
        report = metering_service.utilisation_report(
            info.context.session,
            metering_service.visible_to(auth),
            aware("from", from_),
            aware("to", to),
            granularity.value,
        )
        return shape(UtilisationOut, report)

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
        return shape(FleetHealth, health.summary(info.context.session))

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: every GPU's state as one compact map, for the fleet heatmap",
    )
    def fleet_map(self, info: Info, region: str | None = None) -> FleetMap:
        text_args(region=region)
        m = fleet_map(info.context.session, region)
        return FleetMap(
            **{k: v for k, v in m.items() if k not in ("racks", "mig", "legend")},
            racks=[MapRack(**r) for r in m["racks"]],
            mig=[MapMig(**x) for x in m["mig"]],
            legend=[MapState(**x) for x in m["legend"]],
        )

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: a fleet import's progress and summary",
    )
    def fleet_import(self, info: Info, id: strawberry.ID) -> FleetImportView:  # type: ignore[valid-type]
        row = get_or_404(info.context.session, FleetImport, str(id), what="fleet_import")
        return shape(FleetImportOut, row)

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: ledger against what Stripe was sent, per tenant",
    )
    def reconciliation(self, info: Info, period: str) -> ReconciliationView:  # type: ignore[valid-type]
        auth = info.context.auth
        if not re.fullmatch(PERIOD_PATTERN, period):
            raise ValidationFailed("period is a month: YYYY-MM.", code="validation_error")
        return shape(Reconciliation, stripe_export.reconcile(info.context.session, auth, period))

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: a tenant (REST: GET /v1/admin/tenants/{id})",
    )
    def tenant(self, info: Info, id: strawberry.ID) -> TenantView:  # type: ignore[valid-type]
        auth = info.context.auth
        return shape(
            TenantOut, get_owned(info.context.session, auth, Tenant, str(id), what="tenant")
        )

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: chaos experiments, oldest first, in one state if asked "
        "(REST: GET /v1/admin/chaos/experiments); each one's report: `chaosExperiment`",
    )
    def chaos_experiments(
        self,
        info: Info,
        first: int = 50,
        after: str | None = None,
        state: str | None = None,
    ) -> Connection[ChaosExperimentSummaryView]:  # type: ignore[valid-type]
        try:
            st = ExperimentState(state).value if state is not None else None
        except ValueError:
            raise ValidationFailed(
                f"No experiment state {state!r}.", code="validation_error"
            ) from None
        rows, nxt = chaos.list_experiments(
            info.context.session, page_params(first, after), state=st
        )
        return connection(rows, lambda x: shape(ExperimentSummaryOut, x), nxt)

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: a chaos experiment and its report: per fault, the times to "
        "detect, quarantine, requeue and run again; the invariants "
        "(REST: GET /v1/admin/chaos/experiments/{id})",
    )
    def chaos_experiment(self, info: Info, id: strawberry.ID) -> ChaosExperimentView:  # type: ignore[valid-type]
        session = info.context.session
        exp = get_or_404(session, ChaosExperiment, str(id), what="experiment")
        return shape(ExperimentOut, chaos.experiment_view(session, exp))


NodeResult = _results("NodeResult", Node)
TenantResult = _results("TenantResult", TenantView)
QuotaSetResult = _results("QuotaSetResult", QuotaSetDone)
PriceResult = _results("PriceResult", PriceView)
HealthActionResult = _results("HealthActionResult", HealthActionView)
ChaosExperimentResult = _results("ChaosExperimentResult", ChaosExperimentView)


def _tenant(ctx: Context, id: strawberry.ID) -> Tenant:
    return get_owned(ctx.session, ctx.auth, Tenant, str(id), what="tenant")


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
class OperatorMutation:
    @strawberry.mutation(description="Operators: cordon, drain, mark down or return a node")
    def set_node_state(self, info: Info, id: strawberry.ID, input: NodeStateInput) -> NodeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(NodeStateChange, input)
            node = get_or_404(ctx.session, Row, str(id), what="node")
            change_node_state(ctx.session, node, body.state.value, body.reason)
            return {"node_id": str(id), "body": body}, node, Node.of(node)

        return _run(info, "setNodeState", act)

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
            workloads_service.set_quotas(ctx.session, tenant.id, body.quotas)
            ctx.session.flush()
            quotas = shape(QuotaList, workloads_service.quota_list(ctx.session, tenant.id)).items
            done = QuotaSetDone(tenant_id=strawberry.ID(str(tenant.id)), quotas=quotas)
            return {"tenant_id": str(tenant.id), "body": body}, None, done

        return _run(info, "setTenantQuotas", act)

    @strawberry.mutation(description="Operators: approve a pending (self-service) tenant")
    def approve_tenant(self, info: Info, id: strawberry.ID) -> TenantResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            tenant = tenants.approve(
                get_owned(ctx.session, ctx.auth, Tenant, str(id), what="tenant")
            )
            return {"tenant_id": str(id)}, tenant, shape(TenantOut, tenant)

        return _run(info, "approveTenant", act)

    @strawberry.mutation(
        description="Operators: suspend an active tenant: from its next request, its keys may "
        "only read the tenant itself (`viewer`; everything else is refused with "
        "tenant_not_active, as for a pending tenant); its queued and running workloads carry "
        "on. REST: POST /v1/admin/tenants/{id}:suspend"
    )
    def suspend_tenant(self, info: Info, id: strawberry.ID) -> TenantResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            tenant = tenants.suspend(_tenant(ctx, id))
            return {"tenant_id": str(id)}, tenant, shape(TenantOut, tenant)

        return _run(info, "suspendTenant", act)

    @strawberry.mutation(
        description="Operators: reactivate a suspended tenant: its keys work again. "
        "REST: POST /v1/admin/tenants/{id}:reactivate"
    )
    def reactivate_tenant(self, info: Info, id: strawberry.ID) -> TenantResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            tenant = tenants.reactivate(_tenant(ctx, id))
            return {"tenant_id": str(id)}, tenant, shape(TenantOut, tenant)

        return _run(info, "reactivateTenant", act)

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

        return _run(info, "updateTenant", act)

    @strawberry.mutation(
        description="Operators: add a price version, effective from its date (earlier versions "
        "stay). REST: POST /v1/admin/prices"
    )
    def create_price(self, info: Info, input: PriceInput) -> PriceResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(PriceIn, input)
            price = billing.create_price(ctx.session, **body.model_dump())
            return {"body": body}, price, shape(PriceOut, price)

        return _run(info, "createPrice", act)

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
            done = health.act(ctx.session, node, None, body.action, body.reason)
            return {"node_id": str(node.id), "body": body}, None, shape(HealthActionOut, done)

        return _run(info, "setNodeHealth", act)

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
            done = health.act(ctx.session, node, gpu, body.action, body.reason)
            params = {"gpu_id": str(gpu.id), "node_id": str(node.id), "gpu_index": gpu.index}
            return {**params, "body": body}, None, shape(HealthActionOut, done)

        return _run(info, "setGpuHealth", act)

    @strawberry.mutation(
        description="Operators: stop a chaos experiment and undo what it injected (stopping a "
        "stopped one changes nothing). REST: POST /v1/admin/chaos/experiments/{id}/stop"
    )
    def stop_chaos_experiment(self, info: Info, id: strawberry.ID) -> ChaosExperimentResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            exp = get_or_404(
                ctx.session, ChaosExperiment, str(id), what="experiment", for_update=True
            )
            chaos.stop(ctx.session, exp)
            return {}, exp, shape(ExperimentOut, chaos.experiment_view(ctx.session, exp))

        return _run(info, "stopChaosExperiment", act)
