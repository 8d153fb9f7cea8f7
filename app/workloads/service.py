"""Workload writes: submission (tier, hard limit, budget, region, feasibility), the dry run,
termination, the end of a run, checkpoints.

Its neighbours hold the rest: quotas.py (hard limits, quotas and use), regions.py (region
choice and feasibility reads), reads.py (the list, timelines, manifests), disruptions.py (what
node states, faults and suspect GPUs do to running work), queueing.py (requeue reasons,
placement kicks). Callers import each name from the module that defines it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import as_aware, insert_objects, new_id, utcnow
from app.core.errors import Conflict, ValidationFailed
from app.models.fleet import SoftwareStack
from app.models.keys import SshKey, TenantSecret
from app.models.workloads import Workload, WorkloadDependency, WorkloadEvent
from app.outbox.service import enqueue
from app.placement.model import cuda_code
from app.scheduling import lifecycle, pending
from app.scheduling.apply import release, stopped
from app.scheduling.cycle import dry_run as what_if
from app.scheduling.lifecycle import HOLDING, State
from app.scheduling.world import placed_runtime
from app.tenancy.principal import AuthContext
from app.tenancy.run_tokens import in_stop_grace
from app.tenancy.scoping import scoped_select
from app.workloads import holds, restarts, volumes
from app.workloads.budget_gate import check_submission
from app.workloads.queueing import kick_placement
from app.workloads.quotas import check_limit
from app.workloads.regions import (
    check_feasible,
    choose_region,
    never_fits_row,
    why_waiting,
)
from app.workloads.schemas import WorkloadCreate
from app.workloads.tiers import ShapeFacts, choose_tier


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
    check_limit(auth, body)
    check_submission(session, auth.tenant_id, auth.budget_exhausted)
    region = choose_region(session, body)
    check_stack(session, body.stack)
    keys = ssh_keys_named(session, auth.tenant_id, body.ssh_keys)
    check_secrets(session, auth.tenant_id, body.secret_env)
    mounted = volumes.mounts(session, auth.tenant_id, body.volumes)
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
        min_replicas=body.elastic.min_replicas if body.elastic else None,
        gpu_milli=body.gpu_milli,
        topology=body.topology.model_dump() if body.topology else None,
        region=region,
        stack=body.stack,
        min_cuda=cuda_code(body.min_cuda),
        max_runtime_s=body.max_runtime_s,
        run_for_s=body.run_for_s,
        checkpoint_interval_s=body.checkpoint.interval_s,
        checkpoint_cost_s=body.checkpoint.cost_s,
        labels=dict(body.labels),
        image=body.image,
        workdir=body.workdir,
        command=list(body.command) if body.command is not None else None,
        env=dict(body.env),
        secret_env=dict(body.secret_env),
        volumes=mounted,
        runtime=body.runtime,
        ssh_keys=keys,
        checkpoint_signal=body.checkpoint.signal,
        restart_policy=body.restart_policy.model_dump(),
        restart_counts={},
        checkpoint_requests=0,
        attempts=0,
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


def ssh_keys_named(session: Session, tenant_id: Any, names: list[str]) -> list[str] | None:
    """The public keys of the tenant's SSH keys by these names, in their order; 422
    `unknown_ssh_key` naming any the tenant does not have (another tenant's included)."""
    if not names:
        return None
    stmt = scoped_select(tenant_id, SshKey).where(SshKey.name.in_(names))
    found = {k.name: k.public_key for k in session.scalars(stmt)}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValidationFailed(
            f"You have no SSH key named {', '.join(map(repr, missing))}; add one at "
            "POST /v1/ssh-keys, or list yours at GET /v1/ssh-keys.",
            code="unknown_ssh_key",
            field="ssh_keys",
        )
    return [found[n] for n in names]


def check_secrets(session: Session, tenant_id: Any, refs: dict[str, str]) -> None:
    """422 `unknown_secret` naming any secret `refs` names that the tenant does not have."""
    names = sorted(set(refs.values()))
    if not names:
        return
    # Shared locks: a delete of one of them (which looks for live workloads naming it) waits
    # for this submission's commit, and then sees it.
    stmt = scoped_select(tenant_id, TenantSecret).where(TenantSecret.name.in_(names))
    found = {s.name for s in session.scalars(stmt.with_for_update(read=True))}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValidationFailed(
            f"You have no secret named {', '.join(map(repr, missing))}; set one at "
            "PUT /v1/secrets/{name}, or list yours at GET /v1/secrets.",
            code="unknown_secret",
            field="secret_env",
        )


def check_stack(session: Session, name: str | None) -> None:
    """A workload may ask only for a stack the fleet declares (`app/stacks`)."""
    if name is not None and not session.scalar(
        select(SoftwareStack.id).where(SoftwareStack.name == name)
    ):
        raise ValidationFailed(
            f"No software stack named {name!r}; operators list them at GET /v1/admin/stacks.",
            code="unknown_stack",
            field="stack",
        )


def submit(
    session: Session, auth: AuthContext, body: WorkloadCreate, *, endpoint_id: Any = None
) -> Workload:
    """Store the workload already queued, with both its events (pending, then queued); a job
    array's elements alike, each its own workload (the first is returned). Work that waits for
    its dependencies or its array's limit is queued held back (app/workloads/holds.py). The
    submission path is the API's hottest: Core INSERTs rather than the ORM's unit of work (a
    third of the request's CPU), so the returned object is not in the session. `endpoint_id`:
    a replica of that inference endpoint (app/endpoints)."""
    w = build(session, auth, body)
    w.endpoint_id = endpoint_id
    check_feasible(session, w, body)
    assert auth.tenant_id is not None
    needs = holds.dependencies(session, auth.tenant_id, body.depends_on)
    lifecycle.check(State.pending, State.queued)
    w.state = State.queued.value
    w.last_event_seq = 2
    w.depends_on = [str(i) for i in body.depends_on] or None
    ws = _elements(w, body, needs)
    now = w.created_at
    insert_objects(session, ws)
    if needs:
        insert_objects(
            session, [WorkloadDependency(workload_id=e.id, needs_id=n) for e in ws for n in needs]
        )
    _record_queued(session, ws, len(needs), now)
    held = [e for e in ws if e.hold]
    if held:
        _write_pending(session, held, needs, now)
    if len(held) < len(ws):
        kick_placement(session, w.region)
    return w


def _elements(w: Workload, body: WorkloadCreate, needs: list) -> list[Workload]:
    """`w` and, for a job array, its other elements; each held back if it must wait."""
    ws = [w]
    if body.array is not None:
        w.array_id, w.array_count = new_id(), body.array.count
        w.array_max_parallel = body.array.max_parallel or body.array.count
        ws = [w] + [_copy(w) for _ in range(body.array.count - 1)]
        for i, e in enumerate(ws):
            e.array_index = i
    for e in ws:
        e.hold = (
            holds.DEPENDENCY
            if needs
            else holds.ARRAY_LIMIT
            if e.array_id is not None and e.array_index >= e.array_max_parallel
            else None
        )
    return ws


def _record_queued(session: Session, ws: list[Workload], dependencies: int, now: datetime) -> None:
    """Each element's two events, submitted (pending) then accepted (queued), written at once."""
    accepted = {
        None: "accepted: waits for placement",
        holds.DEPENDENCY: f"accepted: waits for the {dependencies} workloads it depends on",
        holds.ARRAY_LIMIT: "accepted: waits for a place among its array's elements under way",
    }
    for e in ws:
        for seq, (before, after, reason, details) in enumerate(
            [
                (None, State.pending, "submitted", {"tier": e.tier}),
                (State.pending.value, State.queued, accepted[e.hold], None),
            ],
            start=1,
        ):
            lifecycle.record(
                session,
                e,
                kind="transition",
                from_state=before,
                to_state=after.value,
                reason=reason,
                details=details,
                at=now,
                seq=seq,
                flush=False,
            )
    lifecycle.write_events(session)


def _write_pending(session: Session, held: list[Workload], needs: list, now: datetime) -> None:
    """Why each held-back element waits (its dependencies, or its array's limit)."""
    left = (
        session.execute(select(Workload.id, Workload.name).where(Workload.id.in_(needs))).all()
        if needs
        else []
    )
    pending.write(
        session,
        [
            (
                e.id,
                e.tenant_id,
                e.hold,
                holds.waits_for(left, len(left))
                if e.hold == holds.DEPENDENCY
                else holds.array_full(e.array_max_parallel, e.array_max_parallel),
            )
            for e in held
        ],
        now,
    )


def _copy(w: Workload) -> Workload:
    """Another element of `w`'s array: the same columns, an id of its own."""
    e = Workload(**{c.key: getattr(w, c.key) for c in Workload.__mapper__.column_attrs})
    e.id = new_id()
    return e


# What the placement core answers for work it cannot place now, nor later on the nodes as they
# are (app/placement/queueing `what_if`).
NO_FIT = "does not fit the fleet"


def dry_run(session: Session, auth: AuthContext, body: WorkloadCreate) -> dict[str, Any]:
    """What-if: where the workload would land now, whom it would preempt, or when it starts."""
    w = build(session, auth, body)
    assert auth.tenant_id is not None
    needs = holds.dependencies(session, auth.tenant_id, body.depends_on)
    ans = what_if(session, w)
    reason = ans.reason
    if not ans.placeable_now and ans.expected_start is None and reason == NO_FIT:
        # The core sees only the nodes as they are now: say whether it never fits (a 422 on
        # submission), or only waits for nodes that are out, drifted or being laid out.
        why = never_fits_row(session, w)
        reason = (
            f"{NO_FIT}: {why}"
            if why
            else why_waiting(
                session,
                w.region or "",
                tuple(body.gpu_models),
                body.mig_profile,
                placed_runtime(w.runtime, w.tier, bool(w.ssh_keys), w.volumes),
            )
        )
    if needs:  # what it would do once they all succeed
        reason = (
            f"waits for the {len(needs)} workloads it depends on to succeed first; then: "
            f"{reason or 'placeable now'}"
        )
    return {
        "placeable_now": ans.placeable_now and not needs,
        "tier": w.tier,
        "region": w.region,
        "placement": ans.placement,
        "preempts": ans.preempts,
        "preempts_others": ans.preempts_others,
        "expected_start": ans.expected_start,
        "reason": reason,
    }


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


def end_in_failure(
    session: Session, w: Workload, *, reason: str, at: datetime, details: dict
) -> None:
    """Its own process failed (exited non-zero, crashed) by itself: a running workload whose
    restart policy restarts it after its own failure goes back to the queue (its run, and
    usage, ending at `at`), backing off as the policy says, or fails once its restarts are
    spent; any other fails (`finish`)."""
    if w.state != State.running.value or "failure" not in restarts.policy_of(w).on:
        finish(session, w, succeeded=False, reason=reason, at=at, details=details)
        return
    at = min(at, utcnow())
    if w.run_started_at is not None:
        at = max(at, as_aware(w.run_started_at))
    held = release(session, w, at, reason=details.get("cause", "exited"))
    restarts.requeue(
        session, w, "failure", reason, details, at=at, audit_reason=details.get("cause", "failure")
    )
    if held:
        enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=str(w.id))
    kick_placement(session, w.region)


def request_checkpoint(session: Session, w: Workload) -> Workload:
    """Ask a running workload for a checkpoint now (the caller holds `w` locked): its node
    agents send each replica its `checkpoint.signal` once; it reports the checkpoint as any
    other. Asking again before it is sent asks once more."""
    if w.state != State.running.value:
        raise NotRunning(
            f"A {w.state} workload cannot be asked for a checkpoint; only a running one.",
            state=w.state,
        )
    w.checkpoint_requests = (w.checkpoint_requests or 0) + 1
    lifecycle.runs_changed(session, w)
    lifecycle.record(
        session,
        w,
        kind="checkpoint",
        from_state=w.state,
        to_state=w.state,
        reason=f"checkpoint requested ({w.checkpoint_signal} to each replica)",
        details={"requests": w.checkpoint_requests, "signal": w.checkpoint_signal},
    )
    session.flush()
    return w


class NotRunning(Conflict):
    code = "workload_not_running"
    title = "The workload is not running"


def report_checkpoint(
    session: Session,
    w: Workload,
    completed_at: datetime | None,
    size_bytes: int,
    uri: str | None = None,
    step: int | None = None,
) -> WorkloadEvent:
    """Record a completed checkpoint (the caller holds `w` locked); the event it added."""
    running = State(w.state) in (State.running, State.checkpointing)
    if not running and not in_stop_grace(w.state, w.finished_at, utcnow()):
        # (A terminated workload's run writes its last checkpoint in its grace: it counts.)
        raise NotRunning(f"A {w.state} workload has no checkpoints to report.", state=w.state)
    at = completed_at or utcnow()
    if at > utcnow():
        raise ValidationFailed("completed_at is in the future.", code="checkpoint_in_future")
    started = w.started_at
    if started is not None and at < as_aware(started):
        raise ValidationFailed(
            "completed_at is before the workload started.", code="checkpoint_before_start"
        )
    held = w.last_checkpoint_step
    if step is not None and held is not None and step < held:
        # The resume point never moves back: its next run would redo work it had done (or a
        # confused or replayed report would undo a newer one).
        raise Conflict(
            f"Step {step} is behind the resume point's step {held}: a checkpoint's step never "
            "goes back.",
            code="checkpoint_step_behind",
            resume_step=held,
        )
    if w.last_checkpoint_at is None or at > as_aware(w.last_checkpoint_at):
        w.last_checkpoint_at = at
        w.last_checkpoint_bytes = size_bytes
        w.last_checkpoint_uri, w.last_checkpoint_step = uri, step
        if w.migrate_at_checkpoint and w.state == State.running.value:
            # On a suspect GPU: move now, if healthy capacity exists (health.migrate decides).
            enqueue(session, "health.migrate", queue="health", workload_id=str(w.id))
        elif w.current_replicas and w.state == State.running.value:
            # An elastic gang short of its replicas: grow back now, if capacity has returned.
            enqueue(session, "workloads.grow", queue="provisioning", workload_id=str(w.id))
    lifecycle.record(
        session,
        w,
        kind="checkpoint",
        from_state=w.state,
        to_state=w.state,
        reason="checkpoint reported",
        details={
            "completed_at": at.isoformat(),
            "size_bytes": size_bytes,
            **({"uri": uri} if uri else {}),
            **({"step": step} if step is not None else {}),
        },
    )
    return session.scalars(
        select(WorkloadEvent)
        .where(WorkloadEvent.workload_id == w.id)
        .order_by(WorkloadEvent.seq.desc())
        .limit(1)
    ).one()
