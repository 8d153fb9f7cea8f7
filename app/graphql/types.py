"""GraphQL types: what the portal reads. Each is built from the same rows REST returns."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, Generic, TypeVar

import strawberry
from strawberry.scalars import JSON

from app.core.db import as_aware
from app.core.schemas import _encode, cursor_of
from app.workloads.service import manifest


@strawberry.type(description="One replica's place: region, rack, node, GPUs, MIG slot")
class Placement:
    replica: int
    region: str | None
    rack: str | None
    node: str
    gpu_indices: list[int]
    mig_profile: str | None
    mig_slot: int | None

    @classmethod
    def of(cls, p: dict[str, Any]) -> Placement:
        return cls(
            replica=int(p.get("replica", 0)),
            region=p.get("region"),
            rack=p.get("rack"),
            node=p["node"],
            gpu_indices=list(p.get("gpu_indices") or []),
            mig_profile=p.get("mig_profile"),
            mig_slot=p.get("mig_start"),
        )


@strawberry.type(description="A state change or a notice in a workload's life")
class WorkloadEvent:
    seq: int
    kind: str
    from_state: str | None
    to_state: str
    reason: str
    details: JSON
    at: datetime

    @classmethod
    def of(cls, e: Any, **extra: Any) -> Any:
        return cls(
            seq=e.seq,
            kind=e.kind,
            from_state=e.from_state,
            to_state=e.to_state,
            reason=e.reason,
            details=e.details or {},
            at=as_aware(e.at),
            **extra,
        )


@strawberry.type
class Workload:
    id: strawberry.ID
    name: str | None
    kind: str
    state: str
    tier: str
    priority: str
    replicas: int
    gpu_milli: int
    region: str | None
    labels: JSON
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    interruptions: int
    lost_work_gpu_s: float
    shape: JSON = strawberry.field(
        description="What each replica asks for: GPU models, whole GPUs, MIG profile or "
        "fractional share, isolation (as REST's `shape`)"
    )
    topology: JSON | None = strawberry.field(description="A gang's topology constraint")
    preemptions: int
    last_checkpoint_at: datetime | None
    _row: strawberry.Private[Any]
    # Its newest events when the page read them with the workloads (see `events`).
    _events: strawberry.Private[list[Any] | None] = None

    @strawberry.field(description="Per replica, where it runs (empty until placed)")
    def placement(self) -> list[Placement]:
        return [Placement.of(p) for p in self._row.placement or []]

    @strawberry.field(description="Its newest events (at most 20), oldest first")
    def events(self, info: strawberry.Info) -> list[WorkloadEvent]:
        # Read with the page (app/graphql/schema.py: one statement in the page's own thread
        # hop): a list, no awaitable per workload. Otherwise through the request's loader,
        # whose awaitable GraphQL execution awaits.
        if self._events is not None:
            return [WorkloadEvent.of(e) for e in self._events]
        return self._loaded_events(info)  # type: ignore[return-value]

    async def _loaded_events(self, info: strawberry.Info) -> list[WorkloadEvent]:
        rows = await info.context.loaders.events.load(self._row.id)
        return [WorkloadEvent.of(e) for e in rows]

    @strawberry.field(
        description="The Kubernetes manifest a real cluster would run for it (placed workloads)"
    )
    async def manifest(self, info: strawberry.Info) -> JSON:
        return await info.context.run(manifest, info.context.session, self._row)

    @classmethod
    def of(cls, w: Any, events: list[Any] | None = None) -> Workload:
        return cls(
            id=strawberry.ID(str(w.id)),
            name=w.name,
            kind=w.kind,
            state=w.state,
            tier=w.tier,
            priority=w.priority,
            replicas=w.replicas,
            gpu_milli=w.gpu_milli,
            region=w.region,
            labels=dict(w.labels or {}),
            created_at=w.created_at,
            started_at=w.started_at,
            finished_at=w.finished_at,
            interruptions=w.interruptions or 0,
            lost_work_gpu_s=float(w.lost_work_gpu_s or 0.0),
            shape=w.shape.as_json(),
            topology=dict(w.topology) if w.topology else None,
            preemptions=w.preemptions or 0,
            last_checkpoint_at=w.last_checkpoint_at,
            _row=w,
            _events=events,
        )


@strawberry.type
class PageInfo:
    has_next_page: bool
    end_cursor: str | None


@strawberry.type
class WorkloadEdge:
    cursor: str
    node: Workload


@strawberry.type(description="A page of workloads (Relay connection), oldest first")
class WorkloadConnection:
    edges: list[WorkloadEdge]
    page_info: PageInfo


@strawberry.type(description="The calling tenant")
class Viewer:
    id: strawberry.ID
    slug: str
    name: str
    status: str
    isolation_policy: list[str]


def edge_cursor(w: Any) -> str:
    return _encode(w.created_at, w.id)


def node_id(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


@strawberry.type(description="A live allocation on a GPU: whose, at which tier, how much")
class Holder:
    workload_id: strawberry.ID
    tenant_id: strawberry.ID
    replica: int
    tier: str
    milli: int
    mig_profile: str | None
    mig_slot: int | None


@strawberry.type
class Gpu:
    index: int
    model: str
    health: str
    health_reason: str | None
    perf: float = strawberry.field(description="Measured speed over nominal")
    holders: list[Holder] = strawberry.field(description="Who holds it now")


def _holder(h: dict[str, Any]) -> Holder:
    return Holder(
        workload_id=strawberry.ID(str(h["workload_id"])),
        tenant_id=strawberry.ID(str(h["tenant_id"])),
        replica=h["replica"],
        tier=h["tier"],
        milli=h["milli"],
        mig_profile=h["mig_profile"],
        mig_slot=h["mig_slot"],
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
                index=g.index,
                model=g.model,
                health=g.health,
                health_reason=g.health_reason,
                perf=float(g.perf),
                holders=[_holder(h) for h in held.get(g.index, ())],
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
            _row=n,
        )


T = TypeVar("T")


@strawberry.type(description="An item of a page, with the cursor to resume after it")
class Edge(Generic[T]):
    cursor: str
    node: T


@strawberry.type(description="A page (Relay connection), oldest first: every list is one")
class Connection(Generic[T]):
    edges: list[Edge[T]]
    page_info: PageInfo


def connection(rows: list[Any], node_of: Callable[[Any], T], next_cursor: str | None) -> Any:
    """A keyset page of rows (`app.core.schemas.paginate`) as a connection of their views."""
    return Connection(
        edges=[Edge(cursor=cursor_of(r), node=node_of(r)) for r in rows],
        page_info=PageInfo(has_next_page=next_cursor is not None, end_cursor=next_cursor),
    )


@strawberry.type
class NodeEdge:
    cursor: str
    node: Node


@strawberry.type(description="A page of nodes (Relay connection), oldest first")
class NodeConnection:
    edges: list[NodeEdge]
    page_info: PageInfo
