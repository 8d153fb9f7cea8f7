"""Workload writes: submission (tier choice, hard limits), termination, checkpoints; quotas."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.core.config import get_settings
from app.core.db import as_aware, insert_objects, new_id, utcnow
from app.core.errors import Conflict, ValidationFailed
from app.core.schemas import PageParams, paginate
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.tenants import Tenant
from app.models.workloads import Allocation, TenantQuota, Workload, WorkloadEvent
from app.outbox import kicks
from app.outbox.service import enqueue
from app.placement.catalog import GPU_MODELS
from app.scheduling import lifecycle
from app.scheduling.apply import release, stopped
from app.scheduling.cycle import dry_run as what_if
from app.scheduling.lifecycle import HOLDING, TERMINAL, State
from app.tenancy.auth import AuthContext
from app.tenancy.scoping import scoped_select
from app.workloads.budget_gate import check_submission
from app.workloads.schemas import QuotaIn, WorkloadCreate
from app.workloads.tiers import ShapeFacts, choose_tier


class QuotaLimitExceeded(ValidationFailed):
    code = "quota_limit_exceeded"
    title = "Over the tenant's hard limit"


def quotas_of(session: Session, tenant_id: uuid.UUID) -> dict[str, TenantQuota]:
    rows = session.scalars(select(TenantQuota).where(TenantQuota.tenant_id == tenant_id))
    return {q.gpu_model: q for q in rows}


def _check_limit(auth: AuthContext, body: WorkloadCreate) -> None:
    """A request that no allowed GPU model's hard limit could ever hold is refused now; one
    that only has to wait for the tenant's own work to end queues. The limits are those read
    with the key (kept current by the key cache's epoch)."""
    quotas = dict(auth.quota_limits)
    models = body.gpu_models or list(GPU_MODELS)
    limits = []
    for m in models:
        limit = quotas.get(m)
        if limit is None or body.gpu_milli <= limit:
            return
        limits.append(f"{m}: {limit}")
    raise QuotaLimitExceeded(
        f"The workload needs {body.gpu_milli} GPU-milli; the tenant's hard limit is "
        f"{', '.join(limits)}.",
        needed_milli=body.gpu_milli,
    )


class NoMatchingCapacity(ValidationFailed):
    code = "no_matching_capacity"
    title = "No such GPUs in the fleet"


_REGIONS: dict[tuple, tuple[float, str | None]] = {}
REGION_CACHE_SECONDS = 5.0


def choose_region(session: Session, body: WorkloadCreate) -> str:
    """The region named, or the one with the most GPUs of the allowed models. A request no
    region could ever hold is refused now rather than queued forever. Answers are cached for a
    few seconds (the fleet changes by imports, not per request)."""
    import time

    key = (tuple(sorted(body.gpu_models)), body.region)
    hit = _REGIONS.get(key)
    if hit is not None and time.monotonic() - hit[0] < REGION_CACHE_SECONDS and hit[1]:
        return hit[1]
    region = _region_query(session, body)
    _REGIONS[key] = (time.monotonic(), region)
    return region


def forget_regions() -> None:
    """The fleet changed (in this process): choose regions afresh."""
    _REGIONS.clear()
    _NODES.clear()


def _region_query(session: Session, body: WorkloadCreate) -> str:
    stmt = (
        select(Region.name, func.count(Gpu.id))
        .select_from(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .group_by(Region.name)
        .order_by(func.count(Gpu.id).desc(), Region.name)
    )
    if body.gpu_models:
        stmt = stmt.where(Gpu.model.in_(body.gpu_models))
    if body.region:
        stmt = stmt.where(Region.name == body.region)
    row = session.execute(stmt.limit(1)).first()
    if row is None:
        where = f" in region {body.region!r}" if body.region else ""
        models = ", ".join(body.gpu_models) or "any model"
        raise NoMatchingCapacity(f"The fleet has no GPUs of {models}{where}.")
    return row[0]


def build(session: Session, auth: AuthContext, body: WorkloadCreate) -> Workload:
    """The workload `body` asks for on behalf of `auth`'s tenant, checked (tier, hard limit,
    budget, region) but not stored."""
    assert auth.tenant_id is not None  # tenant routes only
    tier = choose_tier(
        body.kind,
        ShapeFacts(body.unit, body.gpus, body.replicas, tuple(body.gpu_models)),
        body.isolation,
        list(auth.tenant_isolation or []),
    )
    _check_limit(auth, body)
    check_submission(session, auth.tenant_id, auth.budget_exhausted)
    region = choose_region(session, body)
    now = utcnow()
    w = Workload(
        tenant_id=auth.tenant_id,
        name=body.name,
        kind=body.kind,
        state=State.pending.value,
        tier=tier.label,
        priority=body.priority,
        shape=body.shape,
        replicas=body.replicas,
        gpu_milli=body.gpu_milli,
        topology=body.topology.model_dump() if body.topology else None,
        region=region,
        max_runtime_s=body.max_runtime_s,
        run_for_s=body.run_for_s,
        checkpoint_interval_s=body.checkpoint.interval_s,
        checkpoint_cost_s=body.checkpoint.cost_s,
        labels=dict(body.labels),
        image=body.image,
        generation=0,
        preemptions=0,
        interruptions=0,
        lost_work_gpu_s=0.0,
        expedited=False,
        migrate_at_checkpoint=False,
        created_at=now,
    )
    w.id = new_id()
    return w


class DoesNotFitFleet(ValidationFailed):
    code = "does_not_fit_fleet"
    title = "The fleet could never hold this request"


_NODES: dict[str, tuple[float, list]] = {}


def region_nodes(session: Session, region: str) -> list:
    """The region's nodes as feasibility sees them, cached like regions (a few seconds)."""
    import time

    from app.workloads.feasibility import NodeCap

    hit = _NODES.get(region)
    if hit is not None and time.monotonic() - hit[0] < REGION_CACHE_SECONDS:
        return hit[1]
    rows = session.execute(
        select(Node.gpu_model, func.count(Gpu.id), Node.nvlink_domain, Rack.name, Rack.block)
        .select_from(Node)
        .join(Gpu, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == region, Node.state != "retired")
        .group_by(Node.id, Node.gpu_model, Node.nvlink_domain, Rack.name, Rack.block)
    )
    nodes = [NodeCap(m, int(n), d, r, b) for m, n, d, r, b in rows]
    _NODES[region] = (time.monotonic(), nodes)
    return nodes


def _never_fits_row(session: Session, w: Workload) -> str | None:
    """`never_fits` for a stored workload (its shape as submitted)."""
    from app.workloads.feasibility import never_fits

    return never_fits(
        region_nodes(session, w.region or ""),
        models=w.shape.gpu_models,
        unit=w.shape.unit,
        gpus=w.shape.gpus,
        replicas=w.replicas,
        kind=w.kind,
        confidential=w.tier == "confidential-vm",
        topology=w.topology,
    )


def fail_what_no_longer_fits(session: Session, region: str) -> int:
    """After the region's fleet shrank for good: waiting work it could never hold now fails
    with the reason, instead of waiting silently. Returns how many."""
    forget_regions()
    failed = 0
    for w in session.scalars(
        select(Workload)
        .where(Workload.region == region, Workload.state == State.queued.value)
        .order_by(Workload.id)
        .with_for_update()
    ):
        why = _never_fits_row(session, w)
        if why:
            lifecycle.transition(
                session,
                w,
                State.failed,
                f"the fleet can no longer hold it: {why}",
                {"cause": "does_not_fit_fleet", "reason": why},
            )
            failed += 1
    return failed


def check_feasible(session: Session, w: Workload, body: WorkloadCreate) -> None:
    """Refuse what the region's fleet could never hold (see app/workloads/feasibility.py)."""
    from app.workloads.feasibility import never_fits

    why = never_fits(
        region_nodes(session, w.region or ""),
        models=tuple(body.gpu_models),
        unit=body.unit,
        gpus=body.gpus,
        replicas=body.replicas,
        kind=body.kind,
        confidential=w.tier == "confidential-vm",
        topology=body.topology.model_dump() if body.topology else None,
    )
    if why:
        raise DoesNotFitFleet(f"It would wait for ever: {why}.", region=w.region, reason=why)


def submit(session: Session, auth: AuthContext, body: WorkloadCreate) -> Workload:
    """Store the workload already queued, with both its events (pending, then queued). The
    submission path is the API's hottest: two Core INSERTs rather than the ORM's unit of work
    (a third of the request's CPU), so the returned object is not in the session."""
    w = build(session, auth, body)
    check_feasible(session, w, body)
    lifecycle.check(State.pending, State.queued)
    w.state = State.queued.value
    w.last_event_seq = 2
    now = w.created_at
    insert_objects(session, [w])
    for seq, (before, after, reason, details) in enumerate(
        [
            (None, State.pending, "submitted", {"tier": w.tier}),
            (State.pending.value, State.queued, "accepted: waits for placement", None),
        ],
        start=1,
    ):
        lifecycle.record(
            session,
            w,
            kind="transition",
            from_state=before,
            to_state=after.value,
            reason=reason,
            details=details,
            at=now,
            seq=seq,
            flush=seq == 2,
        )
    kick_placement(session, w.region)
    return w


def terminate(session: Session, w: Workload, reason: str = "terminated by the customer") -> None:
    if w.state == State.terminated.value:  # DELETE is idempotent: a repeat answers as the first
        return
    held = State(w.state) in HOLDING
    evicted = w.state == State.checkpointing.value  # its GPUs already went to its preemptor
    lifecycle.transition(session, w, State.terminated, reason)
    if held and release(session, w, reason="terminated"):
        enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
        kick_placement(session, w.region)
    elif evicted:
        enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
        stopped(session, w)


def finish(
    session: Session,
    w: Workload,
    *,
    succeeded: bool,
    reason: str,
    at: datetime,
    details: dict,
) -> None:
    """The workload's process ended (it exited, or was stopped at its deadline): a terminal
    state at `at`, its allocations and their usage ending then, not when this runs. During a
    grace period (checkpointing) too: an exit ends the run as it would have without the
    preemption, its allocations (and usage) already ended at the eviction, and its preemptor
    starts now on the GPUs it left."""
    if State(w.state) not in (State.running, State.checkpointing):
        raise NotRunning(f"A {w.state} workload has no process to end.", state=w.state)
    at = min(at, utcnow())
    if w.run_started_at is not None and at < as_aware(w.run_started_at):
        raise ValidationFailed("The exit is before the run started.", code="exit_before_start")
    evicted = w.state == State.checkpointing.value
    if evicted and w.evicted_at is not None:
        # Exited before the eviction, reported after it: its timeline ends once it is evicted
        # (its usage ended there).
        at = max(at, as_aware(w.evicted_at))
    held = release(session, w, at, reason=details.get("cause", "exited"))
    lifecycle.transition(
        session, w, State.succeeded if succeeded else State.failed, reason, details, at=at
    )
    if held or evicted:
        enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
    if held:
        kick_placement(session, w.region)
    if evicted:
        stopped(session, w)


def requeue_reason(w: Workload) -> tuple[str, dict]:
    """What a requeued workload resumes from, said truly: its checkpoint, or the start."""
    at = w.last_checkpoint_at
    if at is None:
        return "requeued: restarts from the beginning (no checkpoint was reported)", {
            "last_checkpoint_at": None,
            "resumes_from": "start",
        }
    return f"requeued: resumes from its checkpoint of {as_aware(at):%Y-%m-%d %H:%M:%S} UTC", {
        "last_checkpoint_at": at.isoformat(),
        "resumes_from": "checkpoint",
    }


# What a node's state does to the work on it: the one table (operators' PATCH of a node).
# ready, cordoned: nothing runs differently (cordoned only stops new placements).
NODE_STATE_EFFECT = {
    "ready": "none",
    "cordoned": "none",
    "draining": "checkpoint then move",  # running work gets its grace, then is requeued
    "down": "stop now",  # the hardware is gone: stopped (usage too) and requeued at once
    # Gone for good: stopped and requeued like `down`; then waiting work the region can no
    # longer hold fails with the reason (fail_what_no_longer_fits).
    "retired": "stop now",
}


def node_state_changed(session: Session, node_id: uuid.UUID, name: str, state: str) -> int:
    """Apply NODE_STATE_EFFECT to every workload holding GPUs on the node. Returns how many
    were moved. Work not yet running (placing, provisioning) goes back to the queue at once."""
    from datetime import timedelta

    effect = NODE_STATE_EFFECT[state]
    if effect == "none":
        return 0
    ids = select(Allocation.workload_id).where(
        Allocation.node_id == node_id, Allocation.released_at.is_(None)
    )
    ws = list(
        session.scalars(
            select(Workload).where(Workload.id.in_(ids)).order_by(Workload.id).with_for_update()
        )
    )
    now, grace = utcnow(), get_settings().preemption_grace_seconds
    regions, entries = set(), []
    for w in ws:
        regions.add(w.region)
        running = w.state == State.running.value
        if effect == "checkpoint then move" and running:
            deadline = now + timedelta(seconds=grace)
            w.evicted_at, w.stop_deadline = now, deadline
            lifecycle.transition(
                session,
                w,
                State.checkpointing,
                f"node {name} is draining: checkpoint before {deadline:%H:%M:%S}, then it moves",
                {"reason": "node_draining", "node": name, "deadline": deadline.isoformat()},
                at=now,
            )
            release(session, w, now, reason="node_draining")
            enqueue(
                session,
                "workloads.finish_preemption",
                queue="provisioning",
                workload_id=str(w.id),
                countdown=grace,
            )
            entries.append((w.tenant_id, "workload", w.id, {"reason": "node_draining"}, {}))
            continue
        if w.state == State.checkpointing.value:
            if effect == "stop now":  # its grace ends with the hardware
                release(session, w, now, reason="node_down")
                lifecycle.transition(
                    session, w, State.preempted, f"stopped: node {name} is {state}", at=now
                )
                reason, details = requeue_reason(w)
                lifecycle.transition(session, w, State.queued, reason, details, at=now)
            continue  # draining: already on its way off
        release(session, w, now, reason=f"node_{state}")
        if running:
            lifecycle.transition(
                session, w, State.preempted, f"stopped: node {name} is {state}", at=now
            )
            reason, details = requeue_reason(w)
        else:  # placing or provisioning: it never started there
            reason = f"node {name} is {state} before it started: back in the queue"
            details = {"node": name}
        lifecycle.transition(session, w, State.queued, reason, details, at=now)
        entries.append((w.tenant_id, "workload", w.id, {"reason": f"node_{state}"}, {}))
    audit.record_system(session, "workload.requeue", entries)
    if state == "retired":
        session.flush()  # the requeued work is judged on the fleet without the node
        fail_what_no_longer_fits(session, node_region(session, node_id))
    for region in regions:
        kick_placement(session, region)
    return len(ws)


def _holders(
    session: Session, node: Node, gpu_indices: list[int] | None, scope: str = "gpu"
) -> list[Workload]:
    """Workloads with live allocations on `node` (on those GPUs, if given), locked. Scope
    "domain": also the multi-GPU work on the other nodes of the node's NVLink domain."""
    nodes = [node.id]
    if scope == "domain":
        nodes = list(
            session.scalars(select(Node.id).where(Node.nvlink_domain == node.nvlink_domain))
        )
    rows = session.execute(
        select(Allocation.workload_id, Allocation.node_id, Allocation.gpu_indices).where(
            Allocation.node_id.in_(nodes), Allocation.released_at.is_(None)
        )
    ).all()
    wanted = set(gpu_indices) if gpu_indices is not None else None
    on_node: set[uuid.UUID] = set()
    elsewhere: set[uuid.UUID] = set()
    for wid, nid, indices in rows:
        if nid == node.id and (wanted is None or wanted & set(indices or [])):
            on_node.add(wid)
        elif nid != node.id:
            elsewhere.add(wid)
    ids = on_node | elsewhere
    if not ids:
        return []
    ws = list(
        session.scalars(
            select(Workload).where(Workload.id.in_(ids)).order_by(Workload.id).with_for_update()
        )
    )
    # Other nodes of the domain: only work spread over GPUs (it talks over the NVLink fabric).
    return [w for w in ws if w.id in on_node or w.gpu_milli > 1000]


def interrupt_on_fault(
    session: Session,
    node: Node,
    gpu_indices: list[int] | None,
    scope: str,
    fault_at: datetime,
    cause: str,
    details: dict,
) -> int:
    """A hardware fault took GPUs away (app/health): every workload holding them stops on all
    its replicas (a gang is one unit). Its usage ends at the fault, not when this runs; the work
    since its last checkpoint is recorded as lost; it goes back to the queue ahead of its
    priority peers, to resume from its last checkpoint. Returns how many were stopped."""
    now = utcnow()
    regions, entries = set(), []
    ws = _holders(session, node, gpu_indices, scope)
    for w in ws:
        state = State(w.state)
        if state not in (State.running, State.placing, State.provisioning):
            continue
        regions.add(w.region)
        if state is State.running:
            run_start = as_aware(w.run_started_at) if w.run_started_at else fault_at
            at = min(max(fault_at, run_start), now)
            ckpt = as_aware(w.last_checkpoint_at) if w.last_checkpoint_at else None
            since = max(run_start, ckpt) if ckpt is not None else run_start
            lost = round(w.gpu_milli / 1000 * max(0.0, (at - since).total_seconds()), 3)
            release(session, w, at, reason="gpu_fault")
            lifecycle.transition(
                session,
                w,
                State.preempted,
                f"interrupted by a hardware fault: {cause}",
                {
                    **details,
                    "fault_at": at.isoformat(),
                    "lost_work_gpu_s": lost,
                    "work_since": since.isoformat(),
                },
                at=at,
            )
            w.interruptions = (w.interruptions or 0) + 1
            w.lost_work_gpu_s = round((w.lost_work_gpu_s or 0.0) + lost, 3)
            reason, more = requeue_reason(w)
        else:  # placed but not started: nothing ran, nothing is lost
            release(session, w, now, reason="gpu_fault")
            reason, more = f"{cause} before it started: back in the queue", {}
        w.expedited = True
        lifecycle.transition(
            session,
            w,
            State.queued,
            f"{reason}; ahead of its priority peers",
            {**more, "expedited": True, "incident": details.get("incident")},
            at=now,
        )
        enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
        entries.append((w.tenant_id, "workload", w.id, {"reason": "gpu_fault"}, {"cause": cause}))
    audit.record_system(session, "workload.requeue", entries)
    for region in regions:
        kick_placement(session, region)
    return len(entries)


def move_off_suspect(
    session: Session, w: Workload, words: str, *, reason: str = "suspect_gpu"
) -> None:
    """A running workload on a suspect GPU just checkpointed and healthy capacity exists: stop
    it now and requeue it ahead of its peers, to resume from that checkpoint elsewhere."""
    now = utcnow()
    ckpt = as_aware(w.last_checkpoint_at) if w.last_checkpoint_at else now
    lost = round(w.gpu_milli / 1000 * max(0.0, (now - ckpt).total_seconds()), 3)
    release(session, w, now, reason="moved_off_suspect_gpu")
    lifecycle.transition(
        session,
        w,
        State.preempted,
        f"moved at its checkpoint: {words}",
        {"reason": reason, "lost_work_gpu_s": lost},
        at=now,
    )
    w.lost_work_gpu_s = round((w.lost_work_gpu_s or 0.0) + lost, 3)
    w.migrate_at_checkpoint = False
    w.expedited = True
    reason, more = requeue_reason(w)
    lifecycle.transition(
        session,
        w,
        State.queued,
        f"{reason}; ahead of its priority peers, on healthy GPUs",
        {**more, "expedited": True},
        at=now,
    )
    enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
    kick_placement(session, w.region)


def health_notice(
    session: Session,
    node_id: uuid.UUID,
    gpu_indices: list[int] | None,
    words: str,
    details: dict,
    *,
    migrate: bool,
) -> int:
    """Tell the workloads running on those GPUs what the health loop saw (an event each). With
    `migrate` (a suspect GPU), work that checkpoints moves off at its next checkpoint."""
    node = session.get(Node, node_id)
    if node is None:
        return 0
    told = 0
    for w in _holders(session, node, gpu_indices):
        if w.state != State.running.value:
            continue
        tell_owner(session, w, words, details, move_to="healthy GPUs" if migrate else None)
        told += 1
    return told


def tell_owner(
    session: Session, w: Workload, words: str, details: dict, *, move_to: str | None
) -> None:
    """A `health` event for the workload's owner; with `move_to`, work that checkpoints moves
    there at its next checkpoint (and the event says so)."""
    if move_to and w.checkpoint_interval_s:
        w.migrate_at_checkpoint = True
        words += f"; it moves to {move_to} at its next checkpoint"
    lifecycle.record(
        session,
        w,
        kind="health",
        from_state=w.state,
        to_state=w.state,
        reason=words[:500],
        details=details,
    )


def node_region(session: Session, node_id: uuid.UUID) -> str:
    return session.scalar(
        select(Region.name)
        .join(Rack, Rack.region_id == Region.id)
        .join(Node, Node.rack_id == Rack.id)
        .where(Node.id == node_id)
    )


def kick_placement(session: Session, region: str | None) -> None:
    """A placement cycle for `region` soon after the commit: work waits there or capacity
    freed up. Coalesced and not durable (the placement tick is the guarantee)."""
    if region:
        kicks.kick(session, "placement.cycle", queue="placement", key=region, region=region)


class NotRunning(Conflict):
    code = "workload_not_running"
    title = "The workload is not running"


def report_checkpoint(
    session: Session, w: Workload, completed_at: datetime | None, size_bytes: int
) -> WorkloadEvent:
    """Record a completed checkpoint (the caller holds `w` locked); the event it added."""
    if State(w.state) not in (State.running, State.checkpointing):
        raise NotRunning(f"A {w.state} workload has no checkpoints to report.", state=w.state)
    at = completed_at or utcnow()
    if at > utcnow():
        raise ValidationFailed("completed_at is in the future.", code="checkpoint_in_future")
    started = w.started_at
    if started is not None and at < as_aware(started):
        raise ValidationFailed(
            "completed_at is before the workload started.", code="checkpoint_before_start"
        )
    if w.last_checkpoint_at is None or at > as_aware(w.last_checkpoint_at):
        w.last_checkpoint_at = at
        w.last_checkpoint_bytes = size_bytes
        if w.migrate_at_checkpoint and w.state == State.running.value:
            # On a suspect GPU: move now, if healthy capacity exists (health.migrate decides).
            enqueue(session, "health.migrate", queue="health", workload_id=str(w.id))
    lifecycle.record(
        session,
        w,
        kind="checkpoint",
        from_state=w.state,
        to_state=w.state,
        reason="checkpoint reported",
        details={"completed_at": at.isoformat(), "size_bytes": size_bytes},
    )
    return session.scalars(
        select(WorkloadEvent)
        .where(WorkloadEvent.workload_id == w.id)
        .order_by(WorkloadEvent.seq.desc())
        .limit(1)
    ).one()


def events_of(session: Session, auth: AuthContext, w: Workload) -> list[WorkloadEvent]:
    """A workload's timeline, in order."""
    return list(
        session.scalars(
            scoped_select(auth, WorkloadEvent)
            .where(WorkloadEvent.workload_id == w.id)
            .order_by(WorkloadEvent.seq)
        )
    )


def quota_list(session: Session, tenant_id: uuid.UUID) -> dict[str, Any]:
    """A tenant's quotas by GPU model, each with the GPU-equivalents held and queued; a model
    the tenant holds GPUs of without a quota row is listed too, as it stands for it (nothing
    guaranteed, no limit)."""
    from app.workloads.schemas import QuotaOut

    held, queued = usage(session, tenant_id)
    quotas: dict[str, Any] = dict(quotas_of(session, tenant_id))
    for model in held.keys() - quotas.keys():
        quotas[model] = QuotaOut(gpu_model=model, guaranteed_milli=0, limit_milli=None, weight=1.0)
    items = []
    for q in sorted(quotas.values(), key=lambda q: q.gpu_model):
        out = QuotaOut.model_validate(q)
        out.used_milli = held.get(q.gpu_model, 0)
        out.queued_milli = queued.get(q.gpu_model, 0)
        items.append(out)
    return {"items": items}


def dry_run(session: Session, auth: AuthContext, body: WorkloadCreate) -> dict[str, Any]:
    """What-if: where the workload would land now, whom it would preempt, or when it starts."""
    w = build(session, auth, body)
    ans = what_if(session, w)
    return {
        "placeable_now": ans.placeable_now,
        "tier": w.tier,
        "region": w.region,
        "placement": ans.placement,
        "preempts": ans.preempts,
        "preempts_others": ans.preempts_others,
        "expected_start": ans.expected_start,
        "reason": ans.reason,
    }


def set_quotas(session: Session, tenant_id: uuid.UUID, quotas: list[QuotaIn]) -> None:
    """Replace the tenant's quotas with `quotas` (models left out have none)."""
    session.execute(delete(TenantQuota).where(TenantQuota.tenant_id == tenant_id))
    for q in quotas:
        session.add(
            TenantQuota(
                tenant_id=tenant_id,
                gpu_model=q.gpu_model,
                guaranteed_milli=q.guaranteed_milli,
                limit_milli=q.limit_milli,
                weight=q.weight,
            )
        )
    session.flush()


def usage(session: Session, tenant_id: uuid.UUID) -> tuple[dict[str, int], dict[str, int]]:
    """(held, queued) GPU-milli per model. Held: the tenant's live allocations (one aggregate on
    their partial index: a tenant may hold thousands); queued: waiting workloads, counted
    against every model they accept."""
    held = {
        model: int(total)
        for model, total in session.execute(
            select(
                Node.gpu_model,
                func.sum(Allocation.milli * func.json_array_length(Allocation.gpu_indices)),
            )
            .join(Node, Node.id == Allocation.node_id)
            .where(Allocation.tenant_id == tenant_id, Allocation.released_at.is_(None))
            .group_by(Node.gpu_model)
        )
    }
    queued: dict[str, int] = {}
    for shape, gpu_milli in session.execute(
        select(Workload.shape, Workload.gpu_milli).where(
            Workload.tenant_id == tenant_id,
            Workload.state.in_([State.queued.value, State.pending.value]),
        )
    ):
        for m in shape.gpu_models or list(GPU_MODELS):
            queued[m] = queued.get(m, 0) + gpu_milli
    return held, queued


def list_workloads(
    session: Session,
    auth: AuthContext,
    page: PageParams,
    *,
    state: State | None = None,
    active: bool | None = None,
    kind: str | None = None,
    priority: str | None = None,
    labels: dict[str, str] | None = None,
    tenant_id: uuid.UUID | None = None,
    region: str | None = None,
    node: str | None = None,
) -> tuple[list[Workload], str | None]:
    """The caller's workloads (every tenant's for operators), oldest first, a page at a time:
    REST's list and GraphQL's connection; filtered by state (or `active`: not yet ended, or
    ended), kind, priority and labels (each `key: value` must be carried)."""
    stmt = scoped_select(auth, Workload)
    if state is not None:
        stmt = stmt.where(Workload.state == state.value)
    if active is not None:
        ended = Workload.state.in_([t.value for t in TERMINAL])
        stmt = stmt.where(~ended if active else ended)
    if kind is not None:
        stmt = stmt.where(Workload.kind == kind)
    if priority is not None:
        stmt = stmt.where(Workload.priority == str(priority))
    for key, value in (labels or {}).items():
        stmt = stmt.where(Workload.labels[key].as_string() == value)
    if tenant_id is not None:
        stmt = stmt.where(Workload.tenant_id == tenant_id)
    if region is not None:
        stmt = stmt.where(Workload.region == region)
    if node is not None:  # the workloads holding GPUs on it
        stmt = stmt.where(
            Workload.id.in_(
                select(Allocation.workload_id)
                .join(Node, Node.id == Allocation.node_id)
                .where(Node.name == node, Allocation.released_at.is_(None))
            )
        )
    return paginate(session, stmt, Workload, page)


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """`["team=ml", "env=prod"]` -> a label filter; a pair without `=` is a 422."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValidationFailed(
                f"A label filter is key=value, not {pair!r}.", code="validation_error"
            )
        out[key] = value
    return out


PLACED = {s.value for s in HOLDING}


class NotPlaced(Conflict):
    code = "workload_not_placed"
    title = "The workload is not placed"


def manifest(session: Session, w: Workload) -> dict[str, Any]:
    """The Kubernetes manifest a real cluster would run for this placed workload."""
    from app.workloads import k8s

    if not w.placement or w.state not in PLACED:
        raise NotPlaced(
            f"A {w.state} workload holds no GPUs, so it has no manifest.", state=w.state
        )
    tenant = session.get(Tenant, w.tenant_id)
    names = {p["node"] for p in w.placement}
    domains = dict(
        session.execute(select(Node.name, Node.nvlink_domain).where(Node.name.in_(names))).all()
    )
    return k8s.manifest(w, tenant.slug, domains)
