"""Workload states and the only transitions allowed between them. Every transition writes an
event row; an invalid one is an error (409 `invalid_state_transition`), never silent."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, event, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.exc import StaleDataError

from app.core import pubsub
from app.core.db import utcnow
from app.core.errors import Conflict
from app.models.agents import AgentNode
from app.models.workloads import State, Workload, WorkloadDependency, WorkloadEvent
from app.outbox.service import enqueue

S = State
TERMINAL = frozenset({S.succeeded, S.failed, S.terminated})
# Holding (or about to hold) GPUs: what counts as a tenant's current use.
HOLDING = frozenset({S.placing, S.provisioning, S.running, S.checkpointing})

TRANSITIONS: dict[State, frozenset[State]] = {
    S.pending: frozenset({S.queued, S.failed, S.terminated}),
    S.queued: frozenset({S.placing, S.failed, S.terminated}),
    # A plan that loses its race (a generation check fails) goes back to the queue.
    S.placing: frozenset({S.provisioning, S.queued, S.failed, S.terminated}),
    S.provisioning: frozenset({S.running, S.queued, S.failed, S.terminated}),
    # Straight to preempted when its hardware is gone (a node down): no grace to give.
    # Straight back to the queue when its own failure restarts it (its restart policy).
    S.running: frozenset(
        {S.checkpointing, S.preempted, S.queued, S.succeeded, S.failed, S.terminated}
    ),
    # Preemption: checkpoint within the grace period, then stop (preempted). A process that
    # exits by itself during its grace ends as any run does: exit 0 is a success.
    S.checkpointing: frozenset({S.preempted, S.running, S.succeeded, S.failed, S.terminated}),
    # Failed instead of requeued when its restart policy says so (or its restarts are spent).
    S.preempted: frozenset({S.queued, S.failed, S.terminated}),
    S.succeeded: frozenset(),
    S.failed: frozenset(),
    S.terminated: frozenset(),
}


class InvalidTransition(Conflict):
    code = "invalid_state_transition"
    title = "Invalid state transition"


def check(current: State | str, to: State | str) -> None:
    cur, new = State(current), State(to)
    if new not in TRANSITIONS[cur]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[cur])) or "none (terminal)"
        raise InvalidTransition(
            f"A {cur.value} workload cannot become {new.value}; allowed: {allowed}.",
            state=cur.value,
            requested=new.value,
        )


def record(
    session: Session,
    w: Workload,
    *,
    kind: str,
    from_state: str | None,
    to_state: str,
    reason: str,
    details: dict[str, Any] | None = None,
    at: datetime | None = None,
    seq: int | None = None,
    flush: bool = True,
) -> None:
    """Append an event, numbered after the workload's latest (`seq` only for a new workload,
    whose numbers the caller knows). The workload row carries the latest seq, so no query.
    Events wait in the session until `write_events` (here when `flush`, by `write`, or at the
    latest before the commit) sends them all in one Core executemany: events are never read
    back as objects, and the ORM would INSERT each with RETURNING for its id."""
    if seq is None:
        seq = (w.last_event_seq or 0) + 1
    if w.placement and to_state not in _SAME_RUNS:
        session.info.setdefault(_NODES, set()).update(p["node"] for p in w.placement)
    w.last_event_seq = max(w.last_event_seq or 0, seq)
    session.info.setdefault(_EVENTS, []).append(
        {
            "workload_id": w.id,
            "tenant_id": w.tenant_id,
            "seq": seq,
            "kind": kind,
            "from_state": from_state,
            "to_state": to_state,
            "reason": reason,
            "details": details or {},
            "at": at or utcnow(),
        }
    )
    if flush:
        write_events(session)


_EVENTS = "rackplane_events_pending"
_NODES = "rackplane_agent_nodes_changed"
# Moves after which a node runs the same processes as before: placed (not started yet: its
# GPUs' previous holders may still be stopping) and running (what the agent reported).
_SAME_RUNS = frozenset({State.placing.value, State.running.value})


def write_events(session: Session) -> None:
    """INSERT the events recorded in this session and not yet written; bump the desired-state
    index of the agent-run nodes whose runs they change, and wake those nodes' agents."""
    nodes = session.info.pop(_NODES, None)
    if nodes:
        t = AgentNode.__table__
        session.execute(
            update(t)
            .where(t.c.node_name.in_(sorted(nodes)))
            .values(desired_index=t.c.desired_index + 1)
        )
        pubsub.mark(session, *(agent_topic(n) for n in nodes))
    rows = session.info.pop(_EVENTS, None)
    if not rows:
        return
    # One executemany (psycopg pipelines it): a multi-row VALUES statement would be compiled
    # afresh each time (3x the CPU for 8 rows, measured).
    session.execute(insert(WorkloadEvent.__table__), rows)
    # Subscribers of these tenants' events read again once (if) this transaction commits.
    pubsub.mark(session, *{events_topic(r["tenant_id"]) for r in rows})


def runs_changed(session: Session, w: Workload) -> None:
    """What `w`'s node agents should do changed without a transition (a checkpoint asked for):
    their nodes' desired-state index goes up with this transaction."""
    if w.placement:
        session.info.setdefault(_NODES, set()).update(p["node"] for p in w.placement)


def nodes_changed(session: Session, names: list[str]) -> None:
    """What these nodes' agents should do changed outside any workload (a burn-in to run):
    their desired-state index goes up with this transaction."""
    session.info.setdefault(_NODES, set()).update(names)


def agent_topic(node_name: str) -> str:
    """The feed topic that wakes the agent of `node_name` waiting for its assignments."""
    return f"agent-node:{node_name}"


def events_topic(tenant_id: Any) -> str:
    """The feed topic (app/core/pubsub.py) of a tenant's workload events."""
    return f"workload-events:{tenant_id}"


@event.listens_for(Session, "before_commit")
def _write_pending(session: Session) -> None:
    write_events(session)


# Workloads that ended in this transaction, and whether one was an array's element: what may
# release (or fail) work held back for them (app/workloads/holds.py).
_ENDED = "rackplane_ended"
_ENDED_ELEMENT = "rackplane_ended_element"


@event.listens_for(Session, "before_commit")
def _release_holds(session: Session) -> None:
    """Work held for a workload that ended here is looked at soon after the commit (the
    `workloads.holds` sweep every few seconds is the guarantee)."""
    ended = session.info.pop(_ENDED, None)
    element = session.info.pop(_ENDED_ELEMENT, False)
    if not ended:
        return
    if element or session.scalar(
        select(WorkloadDependency.workload_id)
        .where(WorkloadDependency.needs_id.in_(ended))
        .limit(1)
    ):
        enqueue(session, "workloads.holds", queue="provisioning")


@event.listens_for(Session, "after_rollback")
def _drop_pending(session: Session) -> None:
    session.info.pop(_EVENTS, None)
    session.info.pop(_NODES, None)
    session.info.pop(_ENDED, None)
    session.info.pop(_ENDED_ELEMENT, None)


def transition(
    session: Session,
    w: Workload,
    to: State,
    reason: str,
    details: dict[str, Any] | None = None,
    *,
    at: datetime | None = None,
    flush: bool = True,
) -> None:
    """Move `w` to `to` (or raise InvalidTransition) and append the event, in the caller's
    transaction (flushed unless the caller batches)."""
    check(w.state, to)
    at = at or utcnow()
    before = w.state
    w.state = to.value
    if to in TERMINAL:
        w.finished_at = at
        w.hold = None
        session.info.setdefault(_ENDED, set()).add(w.id)
        if w.array_id is not None:
            session.info[_ENDED_ELEMENT] = True
    elif to is S.running:
        w.started_at = w.started_at or at
        w.run_started_at = at
        w.expedited = False  # an expedited requeue lasts until it runs again
    elif to is S.preempted:
        w.preempted_at = at
        w.preemptions += 1
    record(
        session,
        w,
        kind="transition",
        from_state=before,
        to_state=to.value,
        reason=reason,
        details=details,
        at=at,
        flush=flush,
    )


# What a transition may change on the workload row (besides its generation).
_MOVED = (
    "state",
    "hold",
    "placement",
    "last_event_seq",
    "started_at",
    "finished_at",
    "preempted_at",
    "preemptions",
    "run_started_at",
    "run_deadline_at",
    "expedited",
    "attempts",
    "ssh_host",
    "ssh_port",
    "ssh_ready_at",
)


def write(session: Session, ws: list[Workload]) -> None:
    """Write the events recorded so far, and the rows of workloads the caller moved (and holds
    locked) in one batched UPDATE instead of the ORM's one versioned UPDATE per row. Each row
    must still be at the generation the caller read: the batch's rowcount proves it, else
    StaleDataError as from the ORM."""
    # Without autoflush: the events' INSERT would first flush the moved rows through the ORM,
    # one versioned UPDATE (one round trip) each, before the batch below wrote them again
    # (10 moved workloads: 11 statements instead of 2, two to three times the CPU and time).
    with session.no_autoflush:
        write_events(session)
    if not ws:
        return
    t = Workload.__table__

    stmt = (
        update(t)
        .where(t.c.id == bindparam("w_id"), t.c.generation == bindparam("w_gen"))
        .values(
            generation=t.c.generation + 1,
            **{c: bindparam(f"v_{c}", type_=t.c[c].type) for c in _MOVED},
        )
    )
    params = [
        {"w_id": w.id, "w_gen": w.generation, **{f"v_{c}": getattr(w, c) for c in _MOVED}}
        for w in ws
    ]
    written = session.connection().execute(stmt, params).rowcount
    if written != len(ws):
        raise StaleDataError(f"{len(ws) - written} of {len(ws)} workloads changed under the batch")
    for w in ws:  # the session now holds what the database holds: nothing left to flush
        for c in _MOVED:
            set_committed_value(w, c, getattr(w, c))
        set_committed_value(w, "generation", w.generation + 1)
