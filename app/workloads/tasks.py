"""Workload tasks. Every task takes ids, re-reads its rows under a lock and does nothing if the
state moved on, so a redelivered or repeated task is harmless."""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta

from celery import shared_task
from sqlalchemy import func, or_, select

from app.core.db import RETRY_DB, as_aware, session_scope, utcnow
from app.core.logging import get_logger
from app.models.workloads import (
    Workload,
    WorkloadEvent,
)
from app.outbox.service import enqueue
from app.scheduling import lifecycle
from app.scheduling.apply import release_unstarted, stopped, unstopped_holders
from app.scheduling.cycle import dry_run
from app.scheduling.lifecycle import State
from app.scheduling.providers import PerNodeProvider, get_provider
from app.workloads import holds, restarts, runs
from app.workloads.disruptions import move_off_suspect
from app.workloads.queueing import kick_placement
from app.workloads.service import finish

log = get_logger(__name__)
POLL_SECONDS = 0.5
# A victim still checkpointing this long after its stop deadline lost its
# `workloads.finish_preemption` (a worker killed during the grace): whoever waits for it (its
# preemptor's provisioning, the reconciler) sends it again. Its preemptor looks again this often.
OVERDUE_SECONDS = 1.0


def _task(name: str):
    """A workload task: takes ids, retried with backoff only when the database is away."""
    return shared_task(
        name=name,
        ignore_result=True,
        autoretry_for=RETRY_DB,
        retry_backoff=True,
        max_retries=20,
    )


def _locked(session, workload_id: str) -> Workload | None:
    return session.scalar(
        select(Workload).where(Workload.id == uuid.UUID(workload_id)).with_for_update()
    )


def _ids(workload_ids: list[str] | None, workload_id: str | None) -> list[str]:
    """Tasks take a batch of ids; a single `workload_id` is the same as a batch of one."""
    return sorted(set(workload_ids or []) | ({workload_id} if workload_id else set()))


def _locked_in(session, ids: list[str], states: set[str]) -> list[Workload]:
    """The workloads of `ids` still in one of `states`, locked, in id order (one lock order
    for every batch, so two batches never deadlock)."""
    rows = session.scalars(
        select(Workload)
        .where(Workload.id.in_([uuid.UUID(i) for i in ids]))
        .order_by(Workload.id)
        .with_for_update()
    )
    return [w for w in rows if w.state in states]


def _provisioning_since(session, ws: list[Workload]) -> dict[uuid.UUID, datetime]:
    """When each workload's latest provisioning began (its last `provisioning` event)."""
    if not ws:
        return {}
    rows = session.execute(
        select(WorkloadEvent.workload_id, func.max(WorkloadEvent.at))
        .where(
            WorkloadEvent.workload_id.in_([w.id for w in ws]),
            WorkloadEvent.to_state == State.provisioning.value,
        )
        .group_by(WorkloadEvent.workload_id)
    )
    return {wid: as_aware(at) for wid, at in rows}


def _until(deadline: datetime | None, now: datetime) -> float:
    """Seconds from `now` to a victim's stop deadline (0 without one)."""
    return 0.0 if deadline is None else (as_aware(deadline) - now).total_seconds()


def _check_later(session, delays: dict[str, float]) -> None:
    """One `workloads.check` per poll step for the workloads due then, not one each."""
    due: dict[float, list[str]] = {}
    for wid, delay in delays.items():
        step = math.ceil(round(delay, 3) / POLL_SECONDS) * POLL_SECONDS
        due.setdefault(step, []).append(wid)
    for step, ids in sorted(due.items()):
        enqueue(session, "workloads.check", queue="provisioning", countdown=step, workload_ids=ids)


@_task("workloads.provision")
def provision(workload_ids: list[str] | None = None, workload_id: str | None = None) -> int:
    """Ask the provider for placed workloads (the batch one placement cycle admitted)."""
    with session_scope() as session:
        ws = _locked_in(
            session,
            _ids(workload_ids, workload_id),
            {State.placing.value, State.provisioning.value},
        )
        # Whoever sent this (the cycle, a reconcile, a redelivery), the GPUs' previous holders
        # keep them until they have stopped: come back at their deadline (their stop sends this
        # again at once), or, past it, stop them and look again shortly.
        wait = unstopped_holders(session, [w for w in ws if w.state == State.placing.value])
        now = utcnow()  # after the holders were read: later than any stop they saw
        overdue: set[uuid.UUID] = set()
        for wid, holders in wait.items():
            left = max(_until(deadline, now) for deadline in holders.values())
            if left <= 0:
                overdue |= {v for v, d in holders.items() if _until(d, now) <= -OVERDUE_SECONDS}
                left = OVERDUE_SECONDS
            log.info("provision_waits_for_holders", workload=str(wid), seconds=round(left, 1))
            enqueue(
                session,
                "workloads.provision",
                queue="provisioning",
                countdown=round(left + 0.05, 2),
                workload_ids=[str(wid)],
            )
        for victim in sorted(overdue):
            log.warning("victim_overdue", workload=str(victim))
            enqueue(
                session,
                "workloads.finish_preemption",
                queue="provisioning",
                workload_id=str(victim),
            )
        ws = [w for w in ws if w.id not in wait]
        moved = [w for w in ws if w.state == State.placing.value]
        provider = get_provider(session)
        for w in moved:
            by = provider.for_workload(w).name
            lifecycle.transition(
                session, w, State.provisioning, f"provisioning ({by})", at=now, flush=False
            )
        lifecycle.write(session, moved)
        session.flush()
        since = _provisioning_since(session, ws)
        _check_later(session, {str(w.id): provider.provision(w, since.get(w.id, now)) for w in ws})
        return len(ws)


@_task("workloads.check")
def check(workload_ids: list[str] | None = None, workload_id: str | None = None) -> dict:
    """Ask the provider whether workloads being provisioned are up: ready ones run, failed ones
    go back to the queue, the rest are asked again a poll step later."""
    out = {"ready": 0, "booting": 0, "failed": 0}
    with session_scope() as session:
        ws = _locked_in(session, _ids(workload_ids, workload_id), {State.provisioning.value})
        since = _provisioning_since(session, ws)
        provider = get_provider(session)
        now = utcnow()
        later: dict[str, float] = {}
        ready, failed = [], []
        for w in ws:
            status = provider.status(w, since.get(w.id, now))
            out[status] += 1
            if status == "booting":
                later[str(w.id)] = provider.poll_seconds(w)
            elif status == "ready":
                ready.append(w)
            else:
                failed.append((w, status))
        runs.start(session, ready, now, provider)
        for w, status in failed:
            nodes = sorted({p["node"] for p in w.placement or []})
            release_unstarted(session, w, reason="provisioning_failed")  # it never ran
            restarts.requeue(
                session,
                w,
                "infrastructure",
                "provisioning failed",
                {"provider_status": status, "nodes": nodes},
                audit_reason="provisioning_failed",
                resumes=False,
            )
            kick_placement(session, w.region)
        _check_later(session, later)
        return out


@_task("workloads.expire")
def expire(workload_ids: list[str] | None = None, workload_id: str | None = None) -> dict:
    """Runs at their deadline end (see `end_run`). A workload whose run changed since
    (preempted and running again) has a later deadline and is left alone."""
    out = {"succeeded": 0, "failed": 0}
    with session_scope() as session:
        ws = _locked_in(
            session,
            _ids(workload_ids, workload_id),
            {State.running.value, State.checkpointing.value},
        )
        now, provider = utcnow(), get_provider(session)
        for w in ws:
            ended = end_run(session, w, provider, now)
            if ended is not None:
                out[ended] += 1
        return out


def end_run(session, w: Workload, provider: PerNodeProvider, now: datetime) -> str | None:
    """End `w`'s run (running, or checkpointing in its grace) if its deadline is past: a
    simulated run that reached its declared length exits 0 (succeeded), any other run past
    max_runtime_s is stopped (failed, max_runtime_exceeded). Usage stops at the deadline, not
    when this runs. Returns the state it ended in, or None when its run goes on."""
    if w.run_deadline_at is None or as_aware(w.run_deadline_at) > now:
        return None
    deadline, started = as_aware(w.run_deadline_at), as_aware(w.run_started_at)
    ran = (deadline - started).total_seconds()
    exits = provider.run_for(w)
    if exits is not None and exits <= w.max_runtime_s:
        finish(
            session,
            w,
            succeeded=True,
            reason=f"the process exited with code 0 after {ran:g} s",
            at=deadline,
            details={"exit_code": 0, "cause": "exited"},
        )
        return "succeeded"
    finish(
        session,
        w,
        succeeded=False,
        reason=f"stopped: ran past its max_runtime_s ({w.max_runtime_s} s)",
        at=deadline,
        details={"cause": "max_runtime_exceeded", "max_runtime_s": w.max_runtime_s},
    )
    return "failed"


@_task("workloads.finish_preemption")
def finish_preemption(workload_id: str, all_stopped: bool = False) -> str:
    """The grace period is over: the victim stops and waits again, from its checkpoint; its
    preemptor may start now. A run that ended by itself during the grace (a simulated run of
    declared length) ended as any run does, not preempted. Sent early (a reconcile), it comes
    back at the deadline, unless `all_stopped`: its node agents saw every replica stop."""
    with session_scope() as session:
        w = _locked(session, workload_id)
        if w is None or w.state != State.checkpointing.value:
            return "skipped"
        now, provider = utcnow(), get_provider(session)
        left = _until(w.stop_deadline, now)
        if left > 0 and not all_stopped:
            enqueue(
                session,
                "workloads.finish_preemption",
                queue="provisioning",
                countdown=round(left, 2),
                workload_id=workload_id,
            )
            return "early"
        ended = end_run(session, w, provider, now)
        if ended is not None:
            return ended
        provider.deprovision(w)
        lifecycle.transition(session, w, State.preempted, "grace period over: stopped", at=now)
        requeued = restarts.requeue(
            session,
            w,
            "preemption",
            "preempted: its grace period is over",
            at=now,
            audit_reason="preempted",
            said=True,
        )
        stopped(session, w)
        kick_placement(session, w.region)
        return "requeued" if requeued else "failed"


@_task("workloads.deprovision")
def deprovision(workload_id: str) -> str:
    with session_scope() as session:
        w = session.get(Workload, uuid.UUID(workload_id))
        if w is None:
            return "missing"
        get_provider(session).deprovision(w)
        return "done"


@_task("workloads.holds")
def release_holds() -> int:
    """Release, or fail, work held for its dependencies or its array's limit (sent when a
    workload ends, and by the beat)."""
    with session_scope() as session:
        return holds.release(session)


STUCK_AFTER_SECONDS = 30.0
# A run this far past its deadline missed its `workloads.expire` (which is idempotent: a nudge
# before it arrives does nothing).
LATE_AFTER_SECONDS = 5.0


@shared_task(name="workloads.reconcile", ignore_result=True)
def reconcile() -> int:
    """Beat: nudge workloads whose follow-up task was lost (a message dropped with a crashed
    worker, a broker outage). The tasks are idempotent, so a spurious nudge does nothing."""
    # How long each state may sit without an event before its task is sent again.
    patience = {
        State.placing.value: ("workloads.provision", STUCK_AFTER_SECONDS),
        State.provisioning.value: ("workloads.check", STUCK_AFTER_SECONDS),
    }
    now = utcnow()
    late_by = now - timedelta(seconds=LATE_AFTER_SECONDS)
    nudged = 0
    with session_scope() as session:
        last = (  # per workload, through the (workload_id, seq) index: no scan of the timeline
            select(func.max(WorkloadEvent.at))
            .where(WorkloadEvent.workload_id == Workload.id)
            .scalar_subquery()
        )
        rows = session.execute(
            select(Workload.id, Workload.state, last)
            .where(Workload.state.in_(list(patience)))
            .limit(1000)
        ).all()
        due: dict[str, list[str]] = {}
        for wid, state, at in rows:
            task, wait = patience[state]
            if at is not None and as_aware(at) > now - timedelta(seconds=wait):
                continue
            due.setdefault(task, []).append(str(wid))
            nudged += 1
        for task, ids in due.items():
            enqueue(session, task, queue="provisioning", workload_ids=ids)
        # Victims past their own stop deadline (a grace may be stretched for a long checkpoint)
        # whose stop was lost: their preemptors wait for them. One grace period each.
        overdue = session.scalars(
            select(Workload.id)
            .where(
                Workload.state == State.checkpointing.value,
                or_(Workload.stop_deadline < late_by, Workload.stop_deadline.is_(None)),
            )
            .limit(1000)
        ).all()
        for wid in overdue:
            enqueue(
                session, "workloads.finish_preemption", queue="provisioning", workload_id=str(wid)
            )
        nudged += len(overdue)
        # Runs past their deadline whose expire message was lost (indexed: running only).
        late = [
            str(wid)
            for (wid,) in session.execute(
                select(Workload.id)
                .where(
                    Workload.state == State.running.value,
                    Workload.run_deadline_at < late_by,
                )
                .limit(1000)
            )
        ]
        if late:
            enqueue(session, "workloads.expire", queue="provisioning", workload_ids=late)
            nudged += len(late)
    if nudged:
        log.warning("workloads_reconciled", nudged=nudged)
    return nudged


@_task("workloads.grow")
def grow(workload_id: str) -> str:
    """An elastic gang short of its replicas reported a checkpoint: if its full size would be
    placed now in place of itself, without preempting anyone, it stops at that checkpoint and
    goes back to the queue ahead of its peers at its full size (a new attempt, resumed from
    it); otherwise it goes on as it is, and its next checkpoint asks again."""
    with session_scope() as session:
        w = _locked(session, workload_id)
        if w is None or w.state != State.running.value or not w.current_replicas:
            return "nothing to do"
        plan = dry_run(session, w, whole=True)
        if not plan.placeable_now or plan.preempts or plan.preempts_others:
            return "stays: no capacity for its full size"
        was, w.current_replicas = w.current_replicas, None
        lifecycle.record(
            session,
            w,
            kind="elastic",
            from_state=w.state,
            to_state=w.state,
            reason=f"grows back from {was} to its {w.replicas} replicas at its checkpoint "
            "(capacity returned)",
            details={"from": was, "to": w.replicas, "replicas": w.replicas},
        )
        move_off_suspect(
            session,
            w,
            f"capacity for all {w.replicas} replicas is back (elastic)",
            reason="elastic_grow",
            then=f"; ahead of its priority peers, at its {w.replicas} replicas",
        )
        return "grows"
