"""Workloads: the caller's workloads and their events, what-if placement, and submitting,
terminating and checkpointing a workload. The same service calls and tenancy scoping as REST's
/v1/workloads routes."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

import strawberry
from strawberry.scalars import JSON
from strawberry.types.nodes import SelectedField

from app.billing import quotes
from app.core.db import as_aware
from app.core.errors import NotFound, ValidationFailed
from app.graphql.arguments import node_id, parse_or_fail
from app.graphql.context import Context, Info
from app.graphql.dataloaders.events import newest as newest_events
from app.graphql.pagination import PageInfo, edge_cursor, page_info, page_params
from app.graphql.permissions import TenantRead
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, text_args, view
from app.models.workloads import Workload as Row
from app.placement.model import cuda_text
from app.scheduling.lifecycle import State
from app.tenancy.principal import require_tenant_scope
from app.tenancy.scoping import get_owned
from app.workloads import reads, restarts, service
from app.workloads.reads import attach_pending, list_workloads
from app.workloads.replies import (
    ArrayOut,
    ConnectOut,
    DryRunOut,
    ElasticOut,
    array_of,
    backing_off_until,
    connect_of,
    elastic_of,
)
from app.workloads.schemas import CheckpointIn, WorkloadCreate

PRIORITIES = ("production", "training", "research", "preemptible")
KINDS = ("instance", "vm", "job")


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


@strawberry.type(description="Where an instance's SSH server is (REST's `connect`)")
class Connect:
    host: str
    port: int
    user: str
    command: str = strawberry.field(description="e.g. `ssh -p 22001 root@10.0.0.7`")
    ready: bool = strawberry.field(description="Its SSH server has answered")
    ready_at: datetime | None

    @classmethod
    def of(cls, c: ConnectOut | None) -> Connect | None:
        return None if c is None else cls(**c.model_dump())


@strawberry.type(description="Why a queued workload waits (as REST's `pending`)")
class Pending:
    reason: str = strawberry.field(
        description="Resources, Priority, QuotaExhausted, FairShare, NodeNotReady, StackDrift, "
        "MigLayoutPending, BackOff, Dependency, ArrayLimit or RuntimeNotOffered"
    )
    detail: str
    since: datetime


@strawberry.type(description="The job array a workload is an element of (REST's `array`)")
class WorkloadArray:
    id: strawberry.ID = strawberry.field(description="The array's id, shared by its elements")
    index: int = strawberry.field(description="This element's index (`RACKPLANE_ARRAY_INDEX`)")
    count: int
    max_parallel: int

    @classmethod
    def of(cls, a: ArrayOut | None) -> WorkloadArray | None:
        if a is None:
            return None
        return cls(
            id=strawberry.ID(str(a.id)), index=a.index, count=a.count, max_parallel=a.max_parallel
        )


@strawberry.type(description="An elastic gang's bounds and its size now (REST's `elastic`)")
class WorkloadElastic:
    min_replicas: int
    current_replicas: int = strawberry.field(
        description="The replicas it is placed or queued at now (its `WORLD_SIZE`)"
    )

    @classmethod
    def of(cls, e: ElasticOut | None) -> WorkloadElastic | None:
        if e is None:
            return None
        return cls(min_replicas=e.min_replicas, current_replicas=e.current_replicas)


@strawberry.type(description="One of your volumes a workload's runs mount (REST's `volumes`)")
class VolumeMount:
    name: str
    storage: str = strawberry.field(description="`node` or `shared`")
    mount_path: str = strawberry.field(
        description="Where its runs see it (relative to a process run's own directory, or "
        "absolute in a container)"
    )
    read_only: bool


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
    last_checkpoint_uri: str | None = strawberry.field(
        description="Where its latest checkpoint is: its next run resumes from it"
    )
    last_checkpoint_step: int | None
    command: list[str] | None = strawberry.field(
        description="The argv each replica's node agent runs (none: the replica holds its GPUs)"
    )
    workdir: str | None = strawberry.field(
        description="Where its command starts (relative to a process run's own directory, or "
        "absolute in a container)"
    )
    env: JSON = strawberry.field(description="Its processes' environment (besides the agent's)")
    secret_env: JSON = strawberry.field(
        description="Environment variables set from your secrets, by secret name (never a value)"
    )
    runtime: str = strawberry.field(description="`process`, `podman` or `vm`")
    ssh_keys: list[str] = strawberry.field(description="The SSH public keys it was launched with")
    connect: Connect | None = strawberry.field(
        description="How to log in while it runs (instances and VMs launched with SSH keys)"
    )
    attempts: int = strawberry.field(description="How many times it has been placed")
    restart_policy: JSON = strawberry.field(
        description="What restarts it after its run ends early, how often, and its back-off "
        "(as REST's `restart_policy`)"
    )
    restarts: JSON = strawberry.field(
        description="The restarts it has had, by cause (`failure`, `infrastructure`, `preemption`)"
    )
    not_before: datetime | None = strawberry.field(
        description="Backing off after a restart: no placement before this moment (queued only)"
    )
    pending: Pending | None = strawberry.field(
        description="Why it waits (queued only), as its region's latest placement cycle saw it"
    )
    stack: str | None = strawberry.field(description="The software stack it runs on, if it asked")
    min_cuda: str | None = strawberry.field(description="The least CUDA version it runs on")
    depends_on: list[strawberry.ID] = strawberry.field(
        description="The workloads and arrays that must succeed before it is placed (as given)"
    )
    array: WorkloadArray | None = strawberry.field(description="The job array it is an element of")
    elastic: WorkloadElastic | None = strawberry.field(
        description="An elastic gang's bounds and size now"
    )
    volumes: list[VolumeMount] = strawberry.field(description="Your volumes its runs mount")
    _row: strawberry.Private[Any]
    # Its newest events when the page read them with the workloads (see `events`).
    _events: strawberry.Private[list[Any] | None] = None

    @strawberry.field(description="Per replica, where it runs (empty until placed)")
    def placement(self) -> list[Placement]:
        return [Placement.of(p) for p in self._row.placement or []]

    @strawberry.field(description="Its newest events (at most 20), oldest first")
    def events(self, info: strawberry.Info) -> list[WorkloadEvent]:
        # Read with the page (`WorkloadQuery.workloads`: one statement in the page's own
        # thread hop): a list, no awaitable per workload. Otherwise through the request's
        # loader, whose awaitable GraphQL execution awaits.
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
        return await info.context.run(reads.manifest, info.context.session, self._row)

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
            last_checkpoint_uri=w.last_checkpoint_uri,
            last_checkpoint_step=w.last_checkpoint_step,
            command=list(w.command) if w.command is not None else None,
            workdir=w.workdir,
            env=dict(w.env or {}),
            secret_env=dict(w.secret_env or {}),
            runtime=w.runtime or "process",
            ssh_keys=list(w.ssh_keys or []),
            connect=Connect.of(connect_of(w)),
            attempts=w.attempts or 0,
            restart_policy=restarts.policy_of(w).model_dump(),
            restarts=dict(w.restart_counts or {}),
            not_before=backing_off_until(w),
            pending=Pending(**p) if (p := getattr(w, "pending", None)) else None,
            stack=w.stack,
            min_cuda=cuda_text(w.min_cuda or 0),
            depends_on=[strawberry.ID(str(i)) for i in w.depends_on or []],
            array=WorkloadArray.of(array_of(w)),
            elastic=WorkloadElastic.of(elastic_of(w)),
            volumes=[
                VolumeMount(
                    name=v["name"],
                    storage=v["storage"],
                    mount_path=v["mount_path"],
                    read_only=bool(v.get("read_only")),
                )
                for v in w.volumes or []
            ],
            _row=w,
            _events=events,
        )


@strawberry.type
class WorkloadEdge:
    cursor: str
    node: Workload


@strawberry.type(description="A page of workloads (Relay connection), oldest first")
class WorkloadConnection:
    edges: list[WorkloadEdge]
    page_info: PageInfo


DryRun = view(DryRunOut, "DryRun", "Where a workload would land now, whom it would preempt")
WorkloadInput = input_view(WorkloadCreate, "WorkloadInput")
CheckpointInput = input_view(CheckpointIn, "CheckpointInput")
WorkloadResult = result_union("WorkloadResult", Workload)
CheckpointResult = result_union("CheckpointResult", WorkloadEvent)


def _selects(selections: list[Any], *path: str) -> bool:
    """Whether `selections` (through fragments) ask for the field at `path` (its GraphQL
    names, e.g. `edges`, `node`, `events`)."""
    head, *rest = path
    for sel in selections:
        if isinstance(sel, SelectedField):
            if sel.name == head and (not rest or _selects(sel.selections, *rest)):
                return True
        elif _selects(sel.selections, *path):  # a fragment's fields are its parent's
            return True
    return False


def _state(state: str | None, kind: str | None, priority: str | None, labels: Any) -> State | None:
    """The `workloads` filters checked as REST checks its query parameters; the state's
    enum member, if one is asked for."""
    try:
        st = State(state) if state is not None else None
    except ValueError:
        raise ValidationFailed(f"No workload state {state!r}.", code="validation_error") from None
    if kind is not None and kind not in KINDS:
        raise ValidationFailed(f"No workload kind {kind!r}.", code="validation_error")
    if priority is not None and priority not in PRIORITIES:
        raise ValidationFailed(f"No priority {priority!r}.", code="validation_error")
    if labels and (
        not isinstance(labels, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        raise ValidationFailed(
            "labels is an object of strings: {key: value}.", code="validation_error"
        )
    text_args(labels=labels or None)
    return st


def _workload(ctx: Context, id: Any) -> Any:
    return get_owned(ctx.session, ctx.auth, Row, str(id), what="workload", for_update=True)


@strawberry.type
class WorkloadQuery:
    @strawberry.field(
        permission_classes=[TenantRead], description="The caller's workloads, oldest first"
    )
    def workloads(
        self,
        info: Info,
        first: int = 50,
        after: str | None = None,
        state: str | None = None,
        kind: str | None = None,
        priority: str | None = None,
        labels: JSON | None = strawberry.UNSET,
        active: Annotated[
            bool | None,
            strawberry.argument(
                description="true: not yet ended (queued to running); false: ended"
            ),
        ] = None,
        array_id: Annotated[
            strawberry.ID | None,
            strawberry.argument(description="A job array's elements (`array.id`)"),
        ] = None,
    ) -> WorkloadConnection:
        auth = info.context.auth
        page = page_params(first, after)
        st = _state(state, kind, priority, labels)
        array = node_id(str(array_id)) if array_id is not None else None
        if array_id is not None and array is None:
            raise ValidationFailed(f"No job array {array_id!r}.", code="validation_error")
        rows, nxt = list_workloads(
            info.context.session,
            auth,
            page,
            state=st,
            active=active,
            kind=kind,
            priority=priority,
            labels=labels or None,
            array_id=array,
        )
        # Their events, when asked for, in the same thread hop: one statement for the page,
        # handed to each workload (no loader, no awaitable per workload).
        events = None
        if rows and any(
            _selects(f.selections, "edges", "node", "events") for f in info.selected_fields
        ):
            events = newest_events(info.context.session, info.context.auth, [w.id for w in rows])
        return WorkloadConnection(
            edges=[
                WorkloadEdge(
                    cursor=edge_cursor(w),
                    node=Workload.of(w, None if events is None else events.get(w.id, [])),
                )
                for w in rows
            ],
            page_info=page_info(nxt),
        )

    @strawberry.field(permission_classes=[TenantRead], description="One of the caller's workloads")
    def workload(self, info: Info, id: strawberry.ID) -> Workload:
        auth = info.context.auth
        wid: uuid.UUID | None = node_id(str(id))
        if wid is None:
            raise NotFound(f"No workload with id {id}.", code="workload_not_found")
        w = get_owned(info.context.session, auth, Row, str(wid), what="workload")
        return Workload.of(attach_pending(info.context.session, [w])[0])

    @strawberry.field(
        permission_classes=[TenantRead],
        description="What-if: where a workload would land now, whom it would preempt, or when "
        "it would start (REST: POST /v1/workloads:dry-run)",
    )
    def dry_run(self, info: Info, input: WorkloadInput) -> DryRun:  # type: ignore[valid-type]
        auth = info.context.auth
        body = parse_or_fail(WorkloadCreate, input)
        return shape(DryRunOut, quotes.dry_run(info.context.session, auth, body))


@strawberry.type
class WorkloadMutation:
    @strawberry.mutation(description="Submit a workload (REST: POST /v1/workloads)")
    def submit_workload(self, info: Info, input: WorkloadInput) -> WorkloadResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(WorkloadCreate, input)
            w = service.submit(ctx.session, ctx.auth, body)
            return {"body": body}, w, Workload.of(w)

        return run_mutation(info, "submitWorkload", act)

    @strawberry.mutation(description="Terminate a workload (REST: DELETE /v1/workloads/{id})")
    def terminate_workload(self, info: Info, id: strawberry.ID) -> WorkloadResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            w = _workload(ctx, id)
            service.terminate(ctx.session, w)
            return {"workload_id": str(id)}, w, Workload.of(w)

        return run_mutation(info, "terminateWorkload", act)

    @strawberry.mutation(
        description="Report a completed checkpoint: preemption or a fault then loses only later "
        "work (REST: POST /v1/workloads/{id}/checkpoints)"
    )
    def report_checkpoint(
        self,
        info: Info,
        id: strawberry.ID,
        input: CheckpointInput,  # type: ignore[valid-type]
    ) -> CheckpointResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(CheckpointIn, input)
            w = _workload(ctx, id)
            ev = service.report_checkpoint(
                ctx.session, w, body.completed_at, body.size_bytes, body.uri, body.step
            )
            return {"workload_id": str(id), "body": body}, ev, WorkloadEvent.of(ev)

        return run_mutation(info, "reportCheckpoint", act)

    @strawberry.mutation(
        description="Ask a running workload for a checkpoint now: its node agents send each "
        "replica its checkpoint signal once (REST: POST /v1/workloads/{id}/checkpoint-requests)"
    )
    def request_checkpoint(self, info: Info, id: strawberry.ID) -> WorkloadResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            w = service.request_checkpoint(ctx.session, _workload(ctx, id))
            return {"workload_id": str(id)}, w, Workload.of(w)

        return run_mutation(info, "requestCheckpoint", act)
