"""What the hardware does to the work on it: a node's state changing (drain, down, retired), a
GPU fault, a suspect GPU's work moved at its checkpoint, and the owner told what the health loop
saw."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.models.fleet import Node
from app.models.workloads import Allocation, Workload
from app.outbox.service import enqueue
from app.scheduling import lifecycle
from app.scheduling.apply import release, release_unstarted
from app.scheduling.lifecycle import State
from app.workloads import restarts
from app.workloads.queueing import kick_placement
from app.workloads.regions import fail_what_no_longer_fits, node_region

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
            entries.append(_drain(session, w, name, now, grace))
        elif w.state == State.checkpointing.value:
            if effect == "stop now":  # its grace ends with the hardware
                _stop_in_grace(session, w, name, state, now)
            # draining: already on its way off
        else:
            _stop_now(session, w, name, state, now, running)
    # The draining ones are preempted now (their requeue, at their grace's end, is audited
    # with it).
    audit.record_system(session, "workload.preempt", entries)
    if state == "retired":
        session.flush()  # the requeued work is judged on the fleet without the node
        fail_what_no_longer_fits(session, node_region(session, node_id))
    for region in regions:
        kick_placement(session, region)
    return len(ws)


def _drain(session: Session, w: Workload, name: str, now: datetime, grace: float) -> tuple:
    """A running workload on a draining node sent to checkpoint, then move; its audit entry."""
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
    return (w.tenant_id, "workload", w.id, {"reason": "node_draining"}, {})


def _stop_in_grace(session: Session, w: Workload, name: str, state: str, now: datetime) -> None:
    """A workload checkpointing on a node gone down or retired: stopped and requeued now."""
    release(session, w, now, reason="node_down")
    lifecycle.transition(session, w, State.preempted, f"stopped: node {name} is {state}", at=now)
    restarts.requeue(
        session,
        w,
        "infrastructure",
        f"node {name} is {state} in its grace",
        {"node": name},
        at=now,
        audit_reason=f"node_{state}",
        said=True,
    )


def _stop_now(
    session: Session, w: Workload, name: str, state: str, now: datetime, running: bool
) -> None:
    """Stopped and requeued now: running work on a node gone, or work not started yet."""
    if running:
        release(session, w, now, reason=f"node_{state}")
    else:  # placed, not started: it never ran, nothing of it is billed
        release_unstarted(session, w, reason=f"node_{state}")
    if running:
        lifecycle.transition(
            session, w, State.preempted, f"stopped: node {name} is {state}", at=now
        )
    restarts.requeue(
        session,
        w,
        "infrastructure",
        f"node {name} is {state}" if running else f"node {name} is {state} before it started",
        {"node": name},
        at=now,
        audit_reason=f"node_{state}",
        resumes=running,
        said=running,
    )


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
    only: set[uuid.UUID] | None = None,
    hardware: bool = True,
) -> int:
    """A hardware fault took GPUs away (app/health), or a node agent lost the process of one of
    its runs (`only` that workload): every workload holding them stops on all its replicas (a
    gang is one unit). Its usage ends at the fault, not when this runs; the work
    since its last checkpoint is recorded as lost; it goes back to the queue ahead of its
    priority peers, to resume from its last checkpoint. Not `hardware`: the node's agent
    failed it (it could not record the run's exit), which is no fault of the GPUs: the same,
    said so, and not counted among its hardware interruptions. Returns how many were stopped."""
    now = utcnow()
    regions, stopped = set(), 0
    ws = _holders(session, node, gpu_indices, scope)
    for w in ws:
        state = State(w.state)
        if state not in (State.running, State.placing, State.provisioning):
            continue
        if only is not None and w.id not in only:
            continue
        regions.add(w.region)
        shrunk = ""
        if state is State.running:
            shrunk = _shrink(session, w, node, gpu_indices)
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
                f"interrupted by a hardware fault: {cause}" if hardware else f"stopped: {cause}",
                {
                    **details,
                    "fault_at": at.isoformat(),
                    "lost_work_gpu_s": lost,
                    "work_since": since.isoformat(),
                },
                at=at,
            )
            if hardware:
                w.interruptions = (w.interruptions or 0) + 1
            w.lost_work_gpu_s = round((w.lost_work_gpu_s or 0.0) + lost, 3)
            what = cause
        else:  # placed but not started: nothing ran, nothing is lost or billed
            release_unstarted(session, w, reason="gpu_fault")
            what = f"{cause} before it started"
        w.expedited = True
        restarts.requeue(
            session,
            w,
            "infrastructure",
            what,
            {"expedited": True, "incident": details.get("incident")},
            at=now,
            audit_reason="gpu_fault",
            operator_details={"cause": cause},
            resumes=state is State.running,
            said=state is State.running,
            then="; ahead of its priority peers" + shrunk,
        )
        enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
        stopped += 1
    for region in regions:
        kick_placement(session, region)
    return stopped


def _shrink(session: Session, w: Workload, node: Node, gpu_indices: list[int] | None) -> str:
    """An elastic gang that lost replicas to the fault goes on with those left, if at least its
    `min_replicas` are (a new attempt at that size, from its last checkpoint); what the requeue
    says of it ("" if it keeps its size)."""
    if not w.min_replicas:
        return ""
    wanted = set(gpu_indices) if gpu_indices is not None else None
    held = session.execute(
        select(Allocation.node_id, Allocation.gpu_indices).where(
            Allocation.workload_id == w.id, Allocation.released_at.is_(None)
        )
    ).all()
    left = sum(
        1
        for nid, indices in held
        if nid != node.id or (wanted is not None and not wanted & set(indices or []))
    )
    if left >= w.size or left < w.min_replicas:
        return ""
    was, w.current_replicas = w.size, left
    lifecycle.record(
        session,
        w,
        kind="elastic",
        from_state=w.state,
        to_state=w.state,
        reason=f"goes on with {left} of its {w.replicas} replicas (elastic; lost {was - left})",
        details={"from": was, "to": left, "replicas": w.replicas, "node": node.name},
    )
    return f"; on {left} of its {w.replicas} replicas (elastic) until capacity returns"


def move_off_suspect(
    session: Session,
    w: Workload,
    words: str,
    *,
    reason: str = "suspect_gpu",
    then: str = "; ahead of its priority peers, on healthy GPUs",
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
    restarts.requeue(
        session,
        w,
        "preemption",
        f"moved at its checkpoint: {words}",
        {"expedited": True},
        at=now,
        audit_reason=reason,
        said=True,
        then=then,
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
