"""The fleet: nodes and their GPUs (and who holds them), regions, racks, free capacity, the
fleet map, imports; and setting a node's state (cordon, drain, down, ready). The same service
calls as REST's fleet and admin routes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import strawberry

from app.agents import mig
from app.agents.schemas import MigLayoutIn, MigRelayoutOut
from app.core.db import get_or_404
from app.fleet import service as fleet_service
from app.fleet.fleetmap import fleet_map
from app.fleet.schemas import (
    Capacity,
    CapacityRow,
    FleetImportOut,
    NodeStateChange,
    RackOut,
    RegionOut,
)
from app.graphql.context import Info
from app.graphql.pagination import (
    Connection,
    PageInfo,
    connection,
    edge_cursor,
    page_info,
    page_params,
)
from app.graphql.permissions import IsOperator, ReadsPrices
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, text_args, view
from app.models.fleet import FleetImport
from app.models.fleet import Gpu as GpuRow
from app.models.fleet import Node as Row
from app.tenancy.principal import require_platform

CapacityRowView = view(CapacityRow, "CapacityRow")
RegionView = view(RegionOut, "Region")
RackView = view(RackOut, "Rack")
FleetImportView = view(FleetImportOut, "FleetImport")
NodeStateInput = input_view(NodeStateChange, "NodeStateInput")


@strawberry.type(description="A live allocation on a GPU: whose, at which tier, how much")
class Holder:
    workload_id: strawberry.ID
    tenant_id: strawberry.ID
    replica: int
    tier: str
    milli: int
    mig_profile: str | None
    mig_slot: int | None

    @classmethod
    def of(cls, h: dict[str, Any]) -> Holder:
        return cls(
            workload_id=strawberry.ID(str(h["workload_id"])),
            tenant_id=strawberry.ID(str(h["tenant_id"])),
            replica=h["replica"],
            tier=h["tier"],
            milli=h["milli"],
            mig_profile=h["mig_profile"],
            mig_slot=h["mig_slot"],
        )


@strawberry.type
class MigSlot:
    profile: str = strawberry.field(description="The generic key (1g, 2g, 3g, 4g, 7g)")
    start: int = strawberry.field(description="Its first memory slice")


@strawberry.type
class Gpu:
    id: strawberry.ID
    index: int
    model: str
    health: str
    health_reason: str | None
    perf: float = strawberry.field(description="Measured speed over nominal")
    holders: list[Holder] = strawberry.field(description="Who holds it now")
    mig_mode: bool
    mig_layout: list[MigSlot] | None = strawberry.field(
        description="Its MIG instances as its node's agent laid them out (null: none laid out)"
    )
    relayout_pending: bool = strawberry.field(
        description="A MIG layout is being applied: it takes no work until then"
    )


@strawberry.type
class Node:
    id: strawberry.ID
    name: str
    gpu_model: str
    state: str
    health: str
    health_reason: str | None
    nvlink_domain: str
    pool: str | None = strawberry.field(description="The operator's grouping for stacks")
    stack_id: strawberry.ID | None = strawberry.field(description="The stack it should run")
    drift: list[str] = strawberry.field(
        description="Each component its agent reports at another version than its stack pins"
    )
    production_at: datetime | None = strawberry.field(
        description="When its first burn-in passed (its time to production ends there)"
    )
    _row: strawberry.Private[Any]

    @strawberry.field
    async def rack(self, info: strawberry.Info) -> str:
        return (await info.context.loaders.racks.load(self._row.rack_id))[0]

    @strawberry.field
    async def region(self, info: strawberry.Info) -> str:
        return (await info.context.loaders.racks.load(self._row.rack_id))[1]

    @strawberry.field
    async def gpus(self, info: strawberry.Info) -> list[Gpu]:
        # The GPUs and their holders together: one await per node, not one per GPU (a page of
        # 100 nodes is 800 GPUs; each await through a loader cost more than its fields).
        gpus = await info.context.loaders.gpus.load(self._row.id)
        held = await info.context.loaders.holders.load(self._row.id)
        return [
            Gpu(
                id=strawberry.ID(str(g.id)),
                index=g.index,
                model=g.model,
                health=g.health,
                health_reason=g.health_reason,
                perf=float(g.perf),
                holders=[Holder.of(h) for h in held.get(g.index, ())],
                mig_mode=g.mig_mode,
                mig_layout=[MigSlot(profile=k, start=st) for k, st in g.mig_layout]
                if g.mig_layout is not None
                else None,
                relayout_pending=g.relayout_pending,
            )
            for g in gpus
        ]

    @classmethod
    def of(cls, n: Any) -> Node:
        return cls(
            id=strawberry.ID(str(n.id)),
            name=n.name,
            gpu_model=n.gpu_model,
            state=n.state,
            health=n.health,
            health_reason=n.health_reason,
            nvlink_domain=n.nvlink_domain,
            pool=n.pool,
            stack_id=strawberry.ID(str(n.stack_id)) if n.stack_id else None,
            drift=list(n.drift or []),
            production_at=n.production_at,
            _row=n,
        )


@strawberry.type
class NodeEdge:
    cursor: str
    node: Node


@strawberry.type(description="A page of nodes (Relay connection), oldest first")
class NodeConnection:
    edges: list[NodeEdge]
    page_info: PageInfo


NodeResult = result_union("NodeResult", Node)
MigLayoutInput = input_view(MigLayoutIn, "MigLayoutInput")
MigRelayoutView = view(MigRelayoutOut, "MigRelayout", "A MIG layout asked of a GPU, and its fate")
MigRelayoutResult = result_union("MigRelayoutResult", MigRelayoutView)


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


@strawberry.type
class FleetQuery:
    @strawberry.field(
        permission_classes=[IsOperator], description="Operators: the fleet's nodes, oldest first"
    )
    def nodes(
        self,
        info: Info,
        first: int = 50,
        after: str | None = None,
        state: str | None = None,
        gpu_model: str | None = None,
        name: str | None = None,
    ) -> NodeConnection:
        page = page_params(first, after)
        text_args(state=state, gpu_model=gpu_model, name=name)
        rows, nxt = fleet_service.list_nodes(
            info.context.session,
            page,
            state=state,
            gpu_model=gpu_model,
            name=name,
        )
        return NodeConnection(
            edges=[NodeEdge(cursor=edge_cursor(n), node=Node.of(n)) for n in rows],
            page_info=page_info(nxt),
        )

    @strawberry.field(
        permission_classes=[ReadsPrices],
        description="Free capacity by region and GPU model: whole GPUs, milli-GPU, MIG slices",
    )
    def capacity(self, info: Info) -> list[CapacityRowView]:  # type: ignore[valid-type]
        return shape(Capacity, {"items": fleet_service.capacity(info.context.session)}).items

    @strawberry.field(permission_classes=[IsOperator], description="Operators: regions")
    def regions(
        self, info: Info, first: int = 50, after: str | None = None
    ) -> Connection[RegionView]:  # type: ignore[valid-type]
        rows, nxt = fleet_service.list_regions(info.context.session, page_params(first, after))
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
        rows, nxt = fleet_service.list_racks(
            info.context.session,
            page_params(first, after),
            region_id=str(region_id) if region_id else None,
        )
        return connection(rows, lambda r: shape(RackOut, r), nxt)

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


@strawberry.type
class FleetMutation:
    @strawberry.mutation(description="Operators: cordon, drain, mark down or return a node")
    def set_node_state(self, info: Info, id: strawberry.ID, input: NodeStateInput) -> NodeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(NodeStateChange, input)
            node = get_or_404(ctx.session, Row, str(id), what="node")
            fleet_service.change_node_state(ctx.session, node, body.state.value, body.reason)
            return {"node_id": str(id), "body": body}, node, Node.of(node)

        return run_mutation(info, "setNodeState", act)

    @strawberry.mutation(
        description="Operators: lay a GPU out as these MIG instances, or a whole GPU, through "
        "its node's agent, while it is idle (REST: PUT /v1/admin/gpus/{id}/mig-layout)"
    )
    def set_mig_layout(
        self,
        info: Info,
        gpu_id: strawberry.ID,
        input: MigLayoutInput,  # type: ignore[valid-type]
    ) -> MigRelayoutResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_platform(ctx.auth)
            body = parse(MigLayoutIn, input)
            gpu = get_or_404(ctx.session, GpuRow, str(gpu_id), what="gpu", for_update=True)
            out = mig.request_on_gpu(ctx.session, gpu, body, "operator")
            return {"gpu_id": str(gpu_id), "body": body}, out, shape(MigRelayoutOut, out)

        return run_mutation(info, "setMigLayout", act)
