"""What an incident asks of the hardware and the work, carried out GPU by GPU (or for the
node): tell the owners (application errors), watch the GPU (suspect), or take GPUs out
(quarantine, unless the circuit breaker holds), stop the work they held (a gang is one unit:
every replica stops; it is requeued ahead of its peers to resume from its last checkpoint),
and ask the provider for a reset or a reboot. Hardware that faults again after a repair, or
asks for service (RMA), goes out of service."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from app.core.logging import get_logger
from app.health import states
from app.health.actions import Action, Repair, Rule, Scope
from app.health.breaker import breaker_holds
from app.health.classify import describe
from app.health.repairs import repair_began_since, repaired_lately, start_repair
from app.health.states import Actor
from app.health.transitions import H, Where, move
from app.models.fleet import Gpu, Node
from app.models.health import HealthIncident
from app.workloads.disruptions import health_notice, interrupt_on_fault

log = get_logger(__name__)
USABLE = (H.healthy.value, H.suspect.value)


@dataclass
class Outcome:
    incident: uuid.UUID | None = None
    action: str = "none"
    stopped: int = 0
    notified: int = 0
    held_back: str | None = None


def notify_or_watch(
    session: Session,
    at: Where,
    inc: HealthIncident,
    gpu: Gpu | None,
    rule: Rule,
    now: datetime,
    out: Outcome,
) -> None:
    where_words = f"GPU {gpu.index} of node {at.node.name}" if gpu else f"node {at.node.name}"
    words = f"{describe(rule)} on {where_words}"
    if rule.action is Action.watch and gpu is not None and gpu.health == H.healthy.value:
        move(session, at, gpu, H.suspect, words, incident=inc, now=now)
    if rule.action is Action.watch:
        words += ": the GPU is watched; the work keeps running"
    out.notified += health_notice(
        session,
        at.node.id,
        [gpu.index] if gpu is not None else None,
        words,
        {
            "incident": str(inc.id),
            "xid": rule.code if rule.signal == "xid" else None,
            "signal": rule.signal,
            "action": rule.action.value,
        },
        migrate=rule.action is Action.watch,
    )


def take_out(
    session: Session,
    at: Where,
    inc: HealthIncident,
    gpu: Gpu | None,
    gpus: dict[int, Gpu],
    rule: Rule,
    scope: Scope,
    repair: Repair,
    fault_at: datetime,
    latest: datetime,
    now: datetime,
    out: Outcome,
) -> None:
    """A fatal fault: quarantine (unless the breaker holds), stop the work, start the repair.
    A node-level fault (a reboot, a silent agent) moves the node and the GPUs the incident
    names; the node's other GPUs keep their state (the node's keeps them out meanwhile).
    `latest` is when the GPU's (or node's) latest signal happened: a fault counts against a
    repair (out of service) only when it happened after that repair began."""
    node = at.node
    where_words = f"GPU {gpu.index} of node {node.name}" if gpu else f"node {node.name}"
    cause = f"{describe(rule)} on {where_words}"
    node_level = repair is Repair.reboot or gpu is None
    silent = rule.signal == "heartbeat_lost"
    named = [gpu] if gpu is not None else []
    taking = _taking(node, named, gpus, node_level)
    held = breaker_holds(session, at, taking, now)
    if held is not None:
        _hold_back(session, at, inc, gpu, cause, held, now, out)
        return
    details = {
        "xid": rule.code if rule.signal == "xid" else None,
        "signal": rule.signal,
        "action": rule.action.value,
        "source": rule.source,
    }
    # A fault from before a repair of this hardware began (reported late, asking more than
    # that repair does) is no evidence that the repair did not hold: it escalates the repair.
    older = repair_began_since(session, node, gpu, latest)
    refault = not older and repaired_lately(session, node, gpu, latest)
    to_service = repair is Repair.service or (
        gpu is not None and not older and (gpu.health == H.validating.value or refault)
    )
    stopped = _stop_work(session, node, inc, named, scope, node_level, fault_at, cause, details)
    out.stopped += stopped
    inc.scope = max(Scope[inc.scope], scope).name
    if to_service and gpu is not None:
        _out_of_service(session, at, inc, gpu, repair, cause, details, now)
        if not node_level:
            return
    if node_level and silent and refault and node.health != H.out_of_service.value:
        move(
            session,
            at,
            node,
            H.out_of_service,
            f"{cause} again after a reboot",
            incident=inc,
            details=details,
            now=now,
            taken_out=taking,
        )
        return
    subjects: list[Node | Gpu] = [*([node] if node_level else []), *named]
    _quarantine(
        session, at, inc, subjects, node_level, silent, taking, stopped, cause, details, now
    )
    kind = "reboot" if node_level else "reset"
    start_repair(
        session,
        at,
        inc,
        [g for g in named if g.health != H.out_of_service.value],
        kind,
        node_level,
        now,
    )
    inc.repair = max(Repair[inc.repair], repair).name


def _taking(node: Node, named: list[Gpu], gpus: dict[int, Gpu], node_level: bool) -> int:
    """How many GPUs in the pool the fault takes out (what the circuit breaker counts)."""
    if node_level:
        return sum(g.health in USABLE for g in gpus.values()) if node.health in USABLE else 0
    return sum(g.health in USABLE for g in named)


def _hold_back(
    session: Session,
    at: Where,
    inc: HealthIncident,
    gpu: Gpu | None,
    cause: str,
    held: str,
    now: datetime,
    out: Outcome,
) -> None:
    """The breaker holds: nothing is taken out; a healthy GPU the fault names is watched."""
    inc.held_back = held[:300]
    out.held_back = held
    log.warning("health_breaker_open", node=at.node.name, incident=str(inc.id), why=held)
    if gpu is not None and gpu.health == H.healthy.value:
        move(session, at, gpu, H.suspect, f"{cause}; {held}", incident=inc, now=now)


def _stop_work(
    session: Session,
    node: Node,
    inc: HealthIncident,
    named: list[Gpu],
    scope: Scope,
    node_level: bool,
    fault_at: datetime,
    cause: str,
    details: dict[str, Any],
) -> int:
    """Stop the work the fault hit; how many workloads stopped."""
    # Whose work stops: the GPU's, the node's, or the NVLink domain's multi-GPU work.
    stop_scope = "domain" if scope is Scope.domain else "node" if node_level else "gpu"
    return interrupt_on_fault(
        session,
        node,
        [g.index for g in named] if stop_scope == "gpu" else None,
        stop_scope,
        fault_at,
        cause,
        {**details, "incident": str(inc.id)},
    )


def _out_of_service(
    session: Session,
    at: Where,
    inc: HealthIncident,
    gpu: Gpu,
    repair: Repair,
    cause: str,
    details: dict[str, Any],
    now: datetime,
) -> None:
    """The GPU asks for service (RMA), or faulted again after a repair: out of service."""
    if gpu.health != H.out_of_service.value:
        why = cause if repair is Repair.service else f"{cause}: it faulted again after a repair"
        move(
            session,
            at,
            gpu,
            H.out_of_service,
            why,
            incident=inc,
            details=details,
            now=now,
            taken_out=1 if gpu.health in USABLE else 0,
        )
    inc.repair = max(Repair[inc.repair], Repair.service).name


def _quarantine(
    session: Session,
    at: Where,
    inc: HealthIncident,
    subjects: list[Node | Gpu],
    node_level: bool,
    silent: bool,
    taking: int,
    stopped: int,
    cause: str,
    details: dict[str, Any],
    now: datetime,
) -> None:
    """Quarantine (or, a silent node, unreachable) and drain (the work is already stopped)."""
    node = at.node
    for x in subjects:
        if x.health == H.out_of_service.value:
            continue
        first = x.health in USABLE or x.health == H.validating.value
        n = (taking if x is node else 0) if node_level else 1
        if silent and x is node:
            # (A node already being power-cycled stays so: its reboot answers the silence.)
            if x.health != H.unreachable.value and states.allowed(
                x.health, H.unreachable, Actor.system, node=True
            ):
                move(
                    session,
                    at,
                    x,
                    H.unreachable,
                    cause,
                    incident=inc,
                    details=details,
                    now=now,
                    taken_out=n if first else 0,
                )
            continue
        if first or x.health in (H.repairing.value, H.draining.value):
            if x.health != H.quarantined.value:
                move(
                    session,
                    at,
                    x,
                    H.quarantined,
                    cause,
                    incident=inc,
                    details=details,
                    now=now,
                    taken_out=n if first else 0,
                )
            if stopped:
                move(
                    session,
                    at,
                    x,
                    H.draining,
                    f"stopping the work on it ({stopped} workload(s))",
                    incident=inc,
                    now=now,
                )
