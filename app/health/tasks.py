"""Health tasks. They take ids, lock their rows and do nothing when the state moved on, so a
redelivered or repeated message is harmless."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from celery import shared_task
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from app.core.config import get_settings
from app.core.db import RETRY_DB, as_aware, session_scope, utcnow
from app.core.logging import get_logger
from app.health import burnin, idle, incidents, repairs, transitions
from app.health.states import Health
from app.models.fleet import Gpu, Node
from app.models.health import HealthIncident, HealthRepair, IdleIron, IncidentState, NodeHeartbeat
from app.models.workloads import Allocation, Workload
from app.outbox.service import enqueue
from app.scheduling.cycle import dry_run
from app.scheduling.lifecycle import State
from app.workloads.disruptions import move_off_suspect

log = get_logger(__name__)
H = Health
# A repair this far past its due time lost its message; the sweep sends it again.
LATE_AFTER_SECONDS = 5.0


def _task(name: str):
    return shared_task(
        name=name,
        ignore_result=True,
        # A lost race with another writer of the same workloads (placement, expire): run again
        # on fresh rows.
        autoretry_for=(*RETRY_DB, StaleDataError),
        retry_backoff=0.2,
        retry_backoff_max=5,
        max_retries=20,
    )


@_task("health.evaluate")
def evaluate(node_id: str, signals: list[dict]) -> dict:
    """Classify a node's new fault signals and act (incidents.evaluate)."""
    with session_scope() as session:
        out = incidents.evaluate(session, uuid.UUID(node_id), signals)
    if out.incident is not None:
        log.info(
            "health_incident",
            node_id=node_id,
            incident=str(out.incident),
            action=out.action,
            stopped=out.stopped,
            notified=out.notified,
            held_back=out.held_back,
        )
    return {"action": out.action, "stopped": out.stopped, "held_back": out.held_back}


@_task("health.repair")
def repair(repair_id: str) -> str:
    with session_scope() as session:
        return repairs.repair_step(session, uuid.UUID(repair_id))


@_task("health.migrate")
def migrate(workload_id: str) -> str:
    """A workload on a suspect GPU checkpointed: move it if it fits on healthy GPUs now without
    preempting anyone; otherwise it stays, and its next checkpoint asks again."""
    with session_scope() as session:
        w = session.scalar(
            select(Workload).where(Workload.id == uuid.UUID(workload_id)).with_for_update()
        )
        if w is None or w.state != State.running.value or not w.migrate_at_checkpoint:
            return "nothing to do"
        plan = dry_run(session, w)
        if not plan.placeable_now or plan.preempts or plan.preempts_others:
            return "stays: no healthy capacity now"
        held = session.execute(
            select(Node.name, Allocation.gpu_indices, Node.state)
            .join(Allocation, Allocation.node_id == Node.id)
            .where(Allocation.workload_id == w.id, Allocation.released_at.is_(None))
        ).all()
        noisy = any([n, g] in (w.avoid_gpus or []) for n, gs, _ in held for g in gs or ())
        leaving = [n for n, _, state in held if state != "ready"]
        if leaving:  # its node leaves service (a rolling upgrade cordoned it)
            move_off_suspect(
                session, w, f"node {leaving[0]} is leaving service", reason="node_upgrade"
            )
        elif noisy:  # asked to move by a noisy neighbour, not by its GPU's health
            move_off_suspect(
                session, w, "a neighbour saturates its shared GPU", reason="noisy_neighbour"
            )
        else:
            move_off_suspect(session, w, "its GPU is suspect and healthy capacity exists")
        return "moved"


@shared_task(name="health.sweep", ignore_result=True)
def sweep() -> dict:
    """Beat: nodes whose agent went silent (a fault: `heartbeat_lost`) or came back; repairs
    whose message was lost; incidents whose burst window ended; suspect GPUs with no new
    evidence within the window (back to healthy)."""
    now = utcnow()
    out = {"silent": 0, "back": 0, "repairs": 0, "closed": 0, "cleared": 0, "burn_ins": 0}
    with session_scope() as session:
        out["silent"], out["back"] = _silent_or_back(session, now)
        out["burn_ins"] = burnin.overdue(session, now)
        out["repairs"] = _resend_late_repairs(session, now)
        out["closed"] = _close_incidents(session, now)
        out["cleared"] = _clear_suspects(session, now)
        # One look at why each GPU is idle serves both records: idle iron and idle by cause.
        idle_now = idle.idle_now(session)
        out["idle_gpus"] = add_idle_iron(session, now, idle_now)
        idle.record(session, now, idle_now)
    if any(v for k, v in out.items() if k != "idle_gpus"):
        log.info("health_sweep", **out)
    return out


def report_silence(session: Session, node_id: uuid.UUID, seen: datetime, now: datetime) -> None:
    """The node's agent has not been heard since `seen`: a `heartbeat_lost` signal, judged by
    `health.evaluate` (a report since makes it old news)."""
    enqueue(
        session,
        "health.evaluate",
        queue="health",
        node_id=str(node_id),
        signals=[
            {
                "gpu_index": None,
                "signal": "heartbeat_lost",
                "code": None,
                "value": (now - seen).total_seconds(),
                # The fault is dated at its last report: nothing shows its work ran past it,
                # so its usage ends there (not when the silence was noticed).
                "at": seen.timestamp(),
                # Its last report: a report since makes the signal old news.
                "seen": seen.timestamp(),
                "received": now.timestamp(),
            }
        ],
    )


def _silent_or_back(session: Session, now: datetime) -> tuple[int, int]:
    """Nodes whose agent went silent get a `heartbeat_lost` signal; unreachable nodes that
    report again are validated. Returns how many of each."""
    s = get_settings()
    silent_since = now - timedelta(seconds=s.heartbeat_timeout_seconds)
    silent = back = 0
    # Only nodes with an agent can fall silent: on evidence of one (a stream of reports,
    # `NodeHeartbeat`), or cut off by a chaos experiment (whose agent it plays). A node that
    # was pushed telemetry once (an operator, a chaos injection) is not expected to go on.
    # Only those that fell silent or may have come back (the heartbeat's index), not every
    # node with an agent.
    expected = NodeHeartbeat.agent | NodeHeartbeat.partitioned
    rows = session.execute(
        select(Node.id, Node.health, Node.health_since, NodeHeartbeat.last_seen_at, expected)
        .join(NodeHeartbeat, NodeHeartbeat.node_id == Node.id)
        .where(
            ((NodeHeartbeat.last_seen_at < silent_since) & expected)
            | Node.health.in_([H.unreachable.value, H.repairing.value])
        )
    ).all()
    for node_id, health, since, seen, agent in rows:
        seen = as_aware(seen)
        if (
            agent
            and seen < silent_since
            and health
            in (
                H.healthy.value,
                H.suspect.value,
                H.quarantined.value,
                H.draining.value,
                H.validating.value,
            )
        ):
            report_silence(session, node_id, seen, now)
            silent += 1
        elif (
            seen >= silent_since
            and health == H.unreachable.value
            and (since is None or seen > as_aware(since))  # reported since it went silent
        ):
            node = session.scalar(select(Node).where(Node.id == node_id).with_for_update())
            if node is not None and node.health == H.unreachable.value:
                at = transitions.where(session, node)
                transitions.move(session, at, node, H.validating, "the node agent reports again")
                repairs.start_validation(session, node, [], "return", now)
                back += 1
        elif (
            seen >= silent_since
            and health == H.repairing.value
            and (since is None or seen > as_aware(since))  # reported since the repair began
            and repairs.agent_back(session, node_id, now) is not None
        ):
            back += 1
    return silent, back


def _resend_late_repairs(session: Session, now: datetime) -> int:
    """Repairs past their due time lost their message: sent again. Returns how many."""
    n = 0
    late = now - timedelta(seconds=LATE_AFTER_SECONDS)
    for (rid,) in session.execute(
        select(HealthRepair.id)
        .where(HealthRepair.finished_at.is_(None), HealthRepair.due_at < late)
        .limit(1000)
    ):
        enqueue(session, "health.repair", queue="health", repair_id=str(rid))
        n += 1
    return n


def _close_incidents(session: Session, now: datetime) -> int:
    """Open incidents whose burst window passed without a signal are closed. Returns how many."""
    n = 0
    window = timedelta(seconds=get_settings().incident_window_seconds)
    for inc in session.scalars(
        select(HealthIncident)
        .where(
            HealthIncident.state == IncidentState.open,
            HealthIncident.last_signal_at < now - window,
        )
        .limit(1000)
    ):
        inc.state = IncidentState.closed
        inc.closed_at = inc.last_signal_at + window
        n += 1
    return n


def _clear_suspects(session: Session, now: datetime) -> int:
    """Suspect GPUs with no new evidence for a whole breaker window: back to healthy. Returns
    how many."""
    n = 0
    quiet = now - timedelta(seconds=get_settings().breaker_window_seconds)
    for gpu in session.scalars(
        select(Gpu)
        .where(Gpu.health == H.suspect.value, Gpu.health_since < quiet)
        .limit(1000)
        .with_for_update(skip_locked=True)
    ):
        node = session.get(Node, gpu.node_id)
        if node is None:
            continue
        transitions.move(
            session,
            transitions.where(session, node),
            gpu,
            H.healthy,
            "no new fault evidence within the watch window",
        )
        n += 1
    return n


def add_idle_iron(session, now, idle_now: dict | None = None) -> int:
    """Add the GPU-seconds since the last sweep that ready, healthy GPUs spent idle, per
    region and model (idle iron): the idle GPUs `app.health.idle` finds with nothing wrong
    with them (no demand, or stranded). Returns the GPUs idle now."""
    if idle_now is None:
        idle_now = idle.idle_now(session)
    counts: dict[tuple[str, str], int] = {}
    for (region, model, cause), n in idle_now.items():
        if cause in idle.AVAILABLE:
            counts[(region, model)] = counts.get((region, model), 0) + n
    rows = {(r.region, r.gpu_model): r for r in session.scalars(select(IdleIron).with_for_update())}
    # Each sweep counts the idle GPUs it sees for the time since the previous one (at most
    # two sweep periods: a stopped beat does not turn into a burst of idle time).
    cap = 2 * get_settings().health_sweep_seconds
    for key in set(counts) | set(rows):
        row = rows.get(key)
        if row is None:
            session.add(IdleIron(region=key[0], gpu_model=key[1], gpu_seconds=0.0, updated_at=now))
            continue
        dt = min(cap, max(0.0, (now - as_aware(row.updated_at)).total_seconds()))
        row.gpu_seconds += counts.get(key, 0) * dt
        row.updated_at = now
    return sum(counts.values())
