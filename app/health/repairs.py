"""Repairs: the provider's reset (of GPUs) or reboot (of a node), then validation, then back in
service; or out of service when the repair failed. `start_repair` asks the provider and moves
the hardware to repairing; `repair_step` (the `health.repair` task) advances a repair whose
phase is due: repairing -> validating -> healthy.

Also what a repair did to the hardware, as the incident logic asks it: whether a repair
answers a signal (`repair_done_by`, `answers`), and whether the hardware was repaired lately
or is being repaired since a fault."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.health import suite
from app.health.actions import Repair
from app.health.transitions import H, Where, move, where
from app.models.fleet import Gpu, Node
from app.models.health import HealthIncident, HealthRepair, NodeHeartbeat
from app.outbox.service import enqueue
from app.scheduling.providers import get_provider
from app.workloads.queueing import kick_placement

WHAT = {"reboot": "node reboot", "reset": "GPU reset", "return": "node agent's return"}


# --- what a repair does --------------------------------------------------------------------------


def repair_done_by(kind: str, indices: list[int] | None, gpu_index: int | None) -> Repair:
    """What a repair (or validation) of `kind` does for a GPU (or, None, for the node): a
    reboot resets every GPU of the node; a reset only its GPUs; a silent node's return
    validates the node after its agent speaks again (what its silence asked)."""
    if kind == "reboot":
        return Repair.reboot
    if kind == "reset" and gpu_index is not None and gpu_index in (indices or []):
        return Repair.reset
    if kind == "return" and gpu_index is None:
        return Repair.reboot
    return Repair.none


def answers(done: Repair, need: Repair) -> bool:
    """Whether a repair that did `done` to the hardware answers a signal that asks `need` (a
    warning or an application error: any repair of it; never one that did nothing to it)."""
    return done is not Repair.none and done >= need


def silent_since(session: Session, node: Node, since: datetime) -> bool:
    """Whether the node has an agent (shown by its stream of reports, or played by a chaos
    experiment that cut it off: `NodeHeartbeat`) that has not reported since `since`. A node
    pushed telemetry once is validated by time, as a node with no agent."""
    row = session.execute(
        select(NodeHeartbeat.last_seen_at, NodeHeartbeat.agent, NodeHeartbeat.partitioned).where(
            NodeHeartbeat.node_id == node.id
        )
    ).one_or_none()
    if row is None or not (row.agent or row.partitioned):
        return False
    return as_aware(row.last_seen_at) < as_aware(since)


def repaired_lately(session: Session, node: Node, gpu: Gpu | None, at: datetime) -> bool:
    """Whether this GPU (or, for a node-level fault, the node) came back from a repair that
    began before the fault (at `at`) and ended within the refault window of it: a repeat means
    the repair did not hold."""
    since = at - timedelta(seconds=get_settings().refault_window_seconds)
    rows = session.execute(
        select(HealthRepair.kind, HealthRepair.gpu_indices).where(
            HealthRepair.node_id == node.id,
            HealthRepair.outcome == "ok",
            HealthRepair.finished_at >= since,
            HealthRepair.started_at < at,
        )
    ).all()
    if gpu is None:
        return any(kind == "reboot" for kind, _ in rows)
    return any(gpu.index in (indices or []) for _, indices in rows)


def repair_began_since(session: Session, node: Node, gpu: Gpu | None, at: datetime) -> bool:
    """Whether a repair of this GPU (or, None, of the node) began at or after `at`."""
    rows = session.execute(
        select(HealthRepair.kind, HealthRepair.gpu_indices).where(
            HealthRepair.node_id == node.id, HealthRepair.started_at >= at
        )
    ).all()
    index = gpu.index if gpu is not None else None
    return any(repair_done_by(kind, indices, index) is not Repair.none for kind, indices in rows)


# --- starting one --------------------------------------------------------------------------------


def start_repair(
    session: Session,
    at: Where,
    inc: HealthIncident | None,
    gpus: list[Gpu],
    kind: str,
    node_level: bool,
    now: datetime,
) -> HealthRepair | None:
    """Ask the provider for a reset (of `gpus`) or a reboot (of the node); move them to
    repairing; `health.repair` takes it from there."""
    node = at.node
    subjects: list[Node | Gpu] = [*([node] if node_level else []), *gpus]
    subjects = [
        x
        for x in subjects
        if x.health in (H.quarantined.value, H.draining.value, H.unreachable.value)
    ]
    if not subjects:
        return None
    rep = HealthRepair(
        id=uuid.uuid4(),
        node_id=node.id,
        gpu_index=None if node_level else (gpus[0].index if len(gpus) == 1 else None),
        gpu_indices=[g.index for g in gpus],
        kind=kind,
        incident_id=inc.id if inc is not None else None,
        phase="repairing",
        started_at=now,
        due_at=now,
    )
    seconds = get_provider().repair(str(rep.id), kind)  # type: ignore[arg-type]
    rep.due_at = now + timedelta(seconds=seconds)
    session.add(rep)
    what = "node reboot" if kind == "reboot" else "GPU reset"
    why = f"{what} by the provider, about {seconds:.0f} s"
    if inc is not None and inc.signal == "heartbeat_lost":  # see `agent_back`
        why = f"its agent stopped reporting: power-cycled ({why}, or until it reports again)"
    for x in subjects:
        move(
            session,
            at,
            x,
            H.repairing,
            why,
            incident=inc,
            details={"repair": str(rep.id)},
            now=now,
        )
    session.flush()
    enqueue(session, "health.repair", queue="health", countdown=seconds, repair_id=str(rep.id))
    return rep


def start_validation(
    session: Session, node: Node, gpu_indices: list[int], kind: str, now: datetime
) -> HealthRepair:
    """Hardware moved to validating outside a repair (an operator's release, a silent node
    reporting again): `health.repair` returns it to service when validation ends."""
    seconds = get_settings().validate_seconds
    rep = HealthRepair(
        id=uuid.uuid4(),
        node_id=node.id,
        kind=kind,
        gpu_indices=gpu_indices,
        phase="validating",
        started_at=now,
        due_at=now + timedelta(seconds=seconds),
    )
    session.add(rep)
    session.flush()
    enqueue(session, "health.repair", queue="health", countdown=seconds, repair_id=str(rep.id))
    return rep


# --- its steps -----------------------------------------------------------------------------------


def repair_step(session: Session, repair_id: uuid.UUID) -> str:
    """Advance a repair whose phase is due: repairing -> validating (or out of service when the
    provider's repair failed), validating -> healthy. Idempotent; early calls re-enqueue."""
    rep = session.scalar(select(HealthRepair).where(HealthRepair.id == repair_id).with_for_update())
    if rep is None or rep.finished_at is not None:
        return "done"
    now = utcnow()
    if as_aware(rep.due_at) > now:
        enqueue(
            session,
            "health.repair",
            queue="health",
            countdown=(as_aware(rep.due_at) - now).total_seconds(),
            repair_id=str(rep.id),
        )
        return "early"
    node = session.scalar(select(Node).where(Node.id == rep.node_id).with_for_update())
    if node is None:
        rep.finished_at, rep.outcome = now, "failed"
        return "gone"
    at = where(session, node)
    subjects = _subjects(session, rep, node)
    if rep.phase == "repairing":
        return _repaired(session, rep, at, subjects, now)
    return _validated(session, rep, at, subjects, now)


def _subjects(session: Session, rep: HealthRepair, node: Node) -> list[Node | Gpu]:
    """What the repair repairs: its GPUs, and for a node's (a reboot, a return) the node and
    its GPUs left validating. Locked."""
    # "return": a silent node that reports again is validated before use.
    node_level = rep.kind in ("reboot", "return")
    named = Gpu.index.in_(rep.gpu_indices or [])
    gpus = list(
        session.scalars(
            select(Gpu)
            # A node's validation is its GPUs' too: those left validating when it went silent
            # after a reboot (or by another repair) are validated with it.
            .where(
                Gpu.node_id == node.id,
                (named | (Gpu.health == H.validating.value)) if node_level else named,
            )
            .order_by(Gpu.index)
            .with_for_update()
        )
    )
    return [*([node] if node_level else []), *gpus]


def _repaired(
    session: Session, rep: HealthRepair, at: Where, subjects: list[Node | Gpu], now: datetime
) -> str:
    """The provider's repair is due: validating, or out of service when it failed."""
    what = WHAT[rep.kind]
    current = [x for x in subjects if x.health == H.repairing.value]
    if not current:  # moved on meanwhile (an operator, or a worse fault)
        rep.finished_at, rep.outcome = now, "superseded"
        return "superseded"
    if not get_provider(session).repaired(
        str(rep.id),
        rep.kind,  # type: ignore[arg-type]
        at.node.name,
    ):
        for x in current:
            move(
                session,
                at,
                x,
                H.out_of_service,
                f"the {what} failed",
                now=now,
                details={"repair": str(rep.id)},
            )
        rep.finished_at, rep.outcome = now, "failed"
        return "failed"
    return _validate(session, rep, at, current, now, f"{what} done: validating")


def _validate(
    session: Session,
    rep: HealthRepair,
    at: Where,
    current: list[Node | Gpu],
    now: datetime,
    why: str,
) -> str:
    """The repair's hardware (`current`, repairing) on to validation."""
    for x in current:
        move(session, at, x, H.validating, why, now=now, details={"repair": str(rep.id)})
    rep.phase = "validating"
    seconds = get_settings().validate_seconds
    rep.due_at = now + timedelta(seconds=seconds)
    enqueue(session, "health.repair", queue="health", countdown=seconds, repair_id=str(rep.id))
    return "validating"


def agent_back(session: Session, node_id: uuid.UUID, now: datetime) -> str | None:
    """A node power-cycled because its agent fell silent, whose agent reports again: what the
    reboot was for has come about (the host is up), so it is not waited out; the node is
    validated now, and burned in, as after any reboot. A reboot for another cause (an Xid 79,
    an operator's) is waited out: its agent may well report until the reboot comes. Locks the
    repair, then the node (the order of `repair_step`). Returns the repair's next phase, or
    None when there is no such repair."""
    rep = session.scalar(
        select(HealthRepair)
        .where(
            HealthRepair.node_id == node_id,
            HealthRepair.finished_at.is_(None),
            HealthRepair.kind == "reboot",
            HealthRepair.phase == "repairing",
            HealthRepair.incident_id.is_not(None),
        )
        .with_for_update()
    )
    if rep is None:
        return None
    cause = session.scalar(
        select(HealthIncident.signal).where(HealthIncident.id == rep.incident_id)
    )
    if cause != "heartbeat_lost":
        return None
    node = session.scalar(select(Node).where(Node.id == node_id).with_for_update())
    if node is None:
        return None
    at = where(session, node)
    current = [x for x in _subjects(session, rep, node) if x.health == H.repairing.value]
    if node not in current:
        return None  # moved on meanwhile (an operator, or a worse fault)
    return _validate(
        session,
        rep,
        at,
        current,
        now,
        "the node agent reports again: the power cycle is not waited out; validating",
    )


def _validated(
    session: Session, rep: HealthRepair, at: Where, subjects: list[Node | Gpu], now: datetime
) -> str:
    """Validation is due: back in service (or, for a rebooted node whose agent has not
    reported since, unreachable)."""
    node = at.node
    node_level = rep.kind in ("reboot", "return")
    listed = set(rep.gpu_indices or [])
    current = [x for x in subjects if x.health == H.validating.value]
    if node_level and node not in current:
        # The node did not pass (it moved on: silent, a worse fault): the GPUs it would carry
        # along wait for its next validation; its own named GPUs are validated as a reset's.
        current = [x for x in current if isinstance(x, Node) or x.index in listed]
    if rep.kind == "reboot" and node in current and silent_since(session, node, rep.started_at):
        # A node with an agent is validated by hearing from it after the reboot; until then it
        # stays out (the sweep brings it back when it reports).
        move(
            session,
            at,
            node,
            H.unreachable,
            "no report from the node agent since the reboot",
            now=now,
            details={"repair": str(rep.id)},
        )
        rep.phase, rep.finished_at, rep.outcome = "done", now, "silent"
        return "silent"
    if node_level and node in current and suite.wanted(session, node):
        # A node with an agent is burned in before it takes work again: its agent runs the
        # suite, and `burnin.take` returns it to service (or not) from the report.
        b = suite.for_repair(session, rep.id)
        if b is None or b.status == "withdrawn":
            gpus = len(node.gpus)
            b = suite.start(
                session, node, "return" if rep.kind == "return" else "repair", gpus, now, rep.id
            )
            rep.phase = "burn-in"
            rep.due_at = now + timedelta(seconds=suite.limit_s(b))
            enqueue(
                session,
                "health.repair",
                queue="health",
                countdown=suite.limit_s(b),
                repair_id=str(rep.id),
            )
            return "burn-in"
        if b.status == "running":
            return "burn-in"  # the health sweep fails one past its limit (`burnin.overdue`)
        if b.status != "passed":
            return "burn-in failed"
    return return_to_service(session, rep, at, current, now)


def return_to_service(
    session: Session, rep: HealthRepair, at: Where, current: list[Node | Gpu], now: datetime
) -> str:
    """The repair's hardware (`current`, still validating) back in service."""
    for x in current:
        move(
            session,
            at,
            x,
            H.healthy,
            f"validated after the {WHAT[rep.kind]}: back in service",
            now=now,
            details={"repair": str(rep.id)},
        )
    rep.phase = "done"
    rep.finished_at, rep.outcome = now, "ok"

    kick_placement(session, at.region)
    return "healthy"
