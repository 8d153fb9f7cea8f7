"""The health loop's decisions, carried out in the caller's transaction.

`evaluate` takes a node's new fault signals (from telemetry, or a lost heartbeat), groups them
into the node's incident (a burst: signals until the window passes without one), classifies the
incident by its worst row (`actions.py`) and carries out what the incident now asks beyond what
was already done: tell the owners (application errors), watch the GPU (suspect), or take GPUs
out (quarantine), stop the work they held (a gang is one unit: every replica stops), requeue it
ahead of its peers to resume from its last checkpoint, and ask the provider for a reset or a
reboot. The circuit breaker caps what automatic quarantine may take out of a region or rack.
Repairs (`repair_step`) go repairing -> validating -> healthy, or out of service.

Every transition goes through `move`, which checks the state table and writes the history."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.core import pubsub
from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.core.errors import Conflict
from app.core.logging import get_logger
from app.health import actions, states
from app.health.actions import Action, Repair, Rule, Scope
from app.health.states import Actor, Health
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import (
    GpuTelemetry,
    HealthEvent,
    HealthIncident,
    HealthRepair,
    IncidentState,
    NodeHeartbeat,
)
from app.models.workloads import Allocation, GpuUsage, Workload
from app.outbox.service import enqueue
from app.placement.perf import from_step_times, worth_writing
from app.scheduling.lifecycle import State
from app.scheduling.providers import get_provider
from app.workloads import service as workloads
from app.workloads.service import NotRunning, kick_placement, tell_owner

log = get_logger(__name__)
FLEET_TOPIC = "health-events"  # the feed topic (app/core/pubsub.py) of health events
H = Health
MAX_KEPT_SIGNALS = 20


# --- transitions -------------------------------------------------------------------------------


@dataclass
class Where:
    node: Node
    region: str
    rack: str


def where(session: Session, node: Node) -> Where:
    region, rack = session.execute(
        select(Region.name, Rack.name)
        .join(Rack, Rack.region_id == Region.id)
        .where(Rack.id == node.rack_id)
    ).one()
    return Where(node, region, rack)


def move(
    session: Session,
    at: Where,
    subject: Node | Gpu,
    to: Health,
    cause: str,
    *,
    actor: Actor = Actor.system,
    incident: HealthIncident | None = None,
    details: dict[str, Any] | None = None,
    taken_out: int = 0,
    now: datetime | None = None,
) -> None:
    """Move a GPU or node to `to` (or raise InvalidHealthTransition) and record the event."""
    is_node = isinstance(subject, Node)
    states.check(subject.health, to, actor, node=is_node)
    now = now or utcnow()
    before = subject.health
    subject.health = to.value
    subject.health_reason = cause[:500]
    subject.health_since = now
    session.add(
        HealthEvent(
            node_id=at.node.id,
            gpu_index=None if is_node else subject.index,  # type: ignore[union-attr]
            region=at.region,
            rack=at.rack,
            from_state=before,
            to_state=to.value,
            actor=actor.value,
            cause=cause[:500],
            incident_id=incident.id if incident is not None else None,
            details=details or {},
            taken_out=taken_out,
            at=now,
        )
    )
    pubsub.mark(session, FLEET_TOPIC)  # operators' live fleet view reads again after the commit


# --- classification ------------------------------------------------------------------------------


def rule_of(signal: dict[str, Any]) -> Rule:
    kind, code = signal["signal"], signal.get("code")
    if kind == "xid":
        return actions.rule_for_xid(int(code))
    if kind == "recovery_action":
        return actions.rule_for_recovery(int(code)) or actions.rule_for_recovery(-1)  # type: ignore[return-value]
    rule = actions.SIGNALS.get(kind)
    if rule is None:
        return Rule(kind, None, Action.watch, f"unknown signal {kind}", "unknown")
    return rule


def describe(rule: Rule) -> str:
    """Plain words for a row: "Xid 79 (GPU has fallen off the bus)"."""
    if rule.signal == "xid":
        return f"Xid {rule.code} ({rule.what})"
    return rule.what


def _rule_from_incident(inc: HealthIncident) -> Rule:
    if inc.signal == "xid" and inc.code is not None:
        return actions.rule_for_xid(inc.code)
    return Rule(inc.signal, inc.code, Action(inc.action), inc.what, "")


# --- the circuit breaker ------------------------------------------------------------------------


def breaker_limits(region_gpus: int, rack_gpus: int) -> tuple[int, int]:
    s = get_settings()
    return (
        max(s.breaker_min_gpus, int(s.breaker_region_share * region_gpus)),
        max(s.breaker_min_gpus, int(s.breaker_rack_share * rack_gpus)),
    )


def breaker_holds(session: Session, at: Where, taking: int, now: datetime) -> str | None:
    """Why taking `taking` more GPUs out automatically would pass the breaker, or None."""
    if taking <= 0:
        return None
    since = now - timedelta(seconds=get_settings().breaker_window_seconds)
    out_region, out_rack = session.execute(
        select(
            func.coalesce(func.sum(HealthEvent.taken_out), 0),
            func.coalesce(func.sum(HealthEvent.taken_out).filter(HealthEvent.rack == at.rack), 0),
        ).where(
            HealthEvent.region == at.region,
            HealthEvent.actor == Actor.system.value,
            HealthEvent.at >= since,
        )
    ).one()
    region_gpus, rack_gpus = session.execute(
        select(
            func.count(Gpu.id),
            func.count(Gpu.id).filter(Rack.name == at.rack),
        )
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == at.region)
    ).one()
    lim_region, lim_rack = breaker_limits(int(region_gpus), int(rack_gpus))
    window = int(get_settings().breaker_window_seconds)
    if int(out_region) + taking > lim_region:
        return (
            f"circuit breaker: {int(out_region)} of {region_gpus} GPUs of region {at.region} "
            f"already taken out automatically in the last {window} s (limit {lim_region})"
        )
    if int(out_rack) + taking > lim_rack:
        return (
            f"circuit breaker: {int(out_rack)} of {rack_gpus} GPUs of rack {at.rack} already "
            f"taken out automatically in the last {window} s (limit {lim_rack})"
        )
    return None


# --- evaluate ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    incident: uuid.UUID | None = None
    action: str = "none"
    stopped: int = 0
    notified: int = 0
    held_back: str | None = None


def evaluate(session: Session, node_id: uuid.UUID, signals: list[dict[str, Any]]) -> Outcome:
    """Take a node's new signals into its incident and carry out what the incident asks."""
    node = session.scalar(select(Node).where(Node.id == node_id).with_for_update())
    if node is None or not signals:
        return Outcome()
    s = get_settings()
    now = utcnow()
    # The node's latest incident, whatever the sweep made of it: the burst is judged in the
    # signals' time (a late report within the window still joins its burst).
    inc = session.scalar(
        select(HealthIncident)
        .where(HealthIncident.node_id == node.id)
        .order_by(HealthIncident.last_signal_at.desc())
        .limit(1)
    )
    signals = _news(session, node, inc, signals, now)
    if not signals:
        return Outcome()
    at = where(session, node)
    signals = sorted(signals, key=lambda x: x["at"])
    first = _instant(signals[0]["at"], now)
    last = _instant(signals[-1]["at"], now)
    window = timedelta(seconds=s.incident_window_seconds)
    if inc is not None and first - as_aware(inc.last_signal_at) > window:
        if inc.state == IncidentState.open:
            inc.state, inc.closed_at = IncidentState.closed, as_aware(inc.last_signal_at) + window
        inc = None
    elif inc is not None and inc.state != IncidentState.open:
        inc.state, inc.closed_at = IncidentState.open, None
    rules = [rule_of(sig) for sig in signals]
    new_worst = actions.worst(rules)
    if inc is None:
        inc = HealthIncident(
            id=uuid.uuid4(),
            node_id=node.id,
            region=at.region,
            opened_at=first,
            last_signal_at=last,
            signal=new_worst.signal,
            code=new_worst.code,
            action=new_worst.action.value,
            what=describe(new_worst)[:300],
            scope=Scope.none.name,
            repair=Repair.none.name,
            gpu_indices=[],
            signals=[],
            signal_count=0,
        )
        session.add(inc)
    else:
        inc.last_signal_at = max(as_aware(inc.last_signal_at), last)
        old = _rule_from_incident(inc)
        if new_worst.action.rank > old.action.rank:
            inc.signal, inc.code, inc.action = (
                new_worst.signal,
                new_worst.code,
                new_worst.action.value,
            )
            inc.what = describe(new_worst)[:300]
    kept = list(inc.signals or [])
    for sig, rule in zip(signals, rules, strict=True):
        if len(kept) < MAX_KEPT_SIGNALS:
            kept.append(
                {**sig, "action": rule.action.value, "what": describe(rule), "source": rule.source}
            )
    inc.signals = kept
    inc.signal_count = (inc.signal_count or 0) + len(signals)
    gpus_named = sorted(
        {int(sig["gpu_index"]) for sig in signals if sig.get("gpu_index") is not None}
        | set(inc.gpu_indices or [])
    )
    inc.gpu_indices = gpus_named
    session.flush()
    out = Outcome(incident=inc.id, action=inc.action)
    gpus = {
        g.index: g
        for g in session.scalars(
            select(Gpu).where(Gpu.node_id == node.id).order_by(Gpu.index).with_for_update()
        )
    }
    # What the new signals ask, GPU by GPU (a node-level signal names no GPU).
    per_gpu: dict[int | None, list[Rule]] = {}
    latest: dict[int | None, datetime] = {}  # each GPU's latest signal: is it after a repair?
    for sig, rule in zip(signals, rules, strict=True):
        index = sig.get("gpu_index")
        per_gpu.setdefault(index, []).append(rule)
        latest[index] = max(latest.get(index, first), _instant(sig["at"], now))
    fault_at = first
    for index, rs in sorted(per_gpu.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        worst = actions.worst(rs)
        scope, repair = actions.effect(rs)
        gpu = gpus.get(index) if index is not None else None
        if index is not None and gpu is None:
            continue  # a GPU index the node does not have (the agent's mistake)
        if scope is Scope.none:
            _notify_or_watch(session, at, inc, gpu, worst, now, out)
            continue
        _take_out(
            session, at, inc, gpu, gpus, worst, scope, repair, fault_at, latest[index], now, out
        )
    return out


def _news(
    session: Session,
    node: Node,
    inc: HealthIncident | None,
    signals: list[dict[str, Any]],
    now: datetime,
) -> list[dict[str, Any]]:
    """The signals that are news. A fault is acted on once: a message delivered again (the
    outbox sends again what it could not mark sent; a broker redelivers), or the sweep's
    `heartbeat_lost` queued twice for the same silence, must not count as a second fault, least
    of all as a fault after the repair the first one caused. Dropped:
    - a signal the node's latest incident already took in (the same GPU, signal, code and
      instant);
    - a signal that reached the control plane before a repair of its hardware began that
      repairs at least what it asks (that repair answered it, or a stronger fault's did); a
      service-class fault (RMA), only once an operator has returned the GPU since. "Reached":
      when telemetry took it in or the sweep raised it (the server's clock, `received`), else
      when it happened;
    - a silent agent's signal when the node has reported since, or is no longer expected to
      (no agent: see `NodeHeartbeat`)."""
    taken = {
        (k.get("gpu_index"), k.get("signal"), k.get("code"), k.get("at"))
        for k in ((inc.signals or []) if inc is not None else [])
    }
    earliest = min(_instant(x.get("received", x["at"]), now) for x in signals)
    repairs = session.execute(
        select(HealthRepair.kind, HealthRepair.gpu_indices, HealthRepair.started_at).where(
            HealthRepair.node_id == node.id, HealthRepair.started_at >= earliest
        )
    ).all()
    beat = None
    if any(x["signal"] == "heartbeat_lost" for x in signals):
        beat = session.execute(
            select(
                NodeHeartbeat.last_seen_at, NodeHeartbeat.agent, NodeHeartbeat.partitioned
            ).where(NodeHeartbeat.node_id == node.id)
        ).one_or_none()
    out = []
    for sig in signals:
        index = sig.get("gpu_index")
        if (index, sig["signal"], sig.get("code"), sig["at"]) in taken:
            continue
        if sig["signal"] == "heartbeat_lost" and not _still_silent(beat, sig):
            continue
        at = _instant(sig.get("received", sig["at"]), now)
        need = actions.EFFECT[rule_of(sig).action][1]
        if need is Repair.service:
            if index is not None and _returned_since(session, node, index, at):
                continue
        elif any(
            as_aware(started) >= at and _answers(_repairs(kind, indices, index), need)
            for kind, indices, started in repairs
        ):
            continue
        out.append(sig)
    return out


def _repairs(kind: str, indices: list[int] | None, gpu_index: int | None) -> Repair:
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


def _answers(done: Repair, need: Repair) -> bool:
    """Whether a repair that did `done` to the hardware answers a signal that asks `need` (a
    warning or an application error: any repair of it; never one that did nothing to it)."""
    return done is not Repair.none and done >= need


def _still_silent(beat: Any, sig: dict[str, Any]) -> bool:
    if beat is None:
        return False
    last_seen, agent, partitioned = beat
    if not (agent or partitioned):
        return False
    seen = sig.get("seen")
    return seen is None or as_aware(last_seen).timestamp() <= float(seen)


def _returned_since(session: Session, node: Node, gpu_index: int, at: datetime) -> bool:
    """Whether an operator returned this GPU from out of service (after an RMA) since `at`."""
    return (
        session.scalar(
            select(HealthEvent.id)
            .where(
                HealthEvent.node_id == node.id,
                HealthEvent.gpu_index == gpu_index,
                HealthEvent.from_state == H.out_of_service.value,
                HealthEvent.actor == Actor.operator.value,
                HealthEvent.at >= at,
            )
            .limit(1)
        )
        is not None
    )


def _instant(value: Any, now: datetime) -> datetime:
    if isinstance(value, datetime):
        t = as_aware(value)
    else:
        t = datetime.fromtimestamp(float(value), UTC)
    return min(t, now)


def _notify_or_watch(
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
    out.notified += workloads.health_notice(
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


def _take_out(
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
    words = describe(rule)
    where_words = f"GPU {gpu.index} of node {node.name}" if gpu else f"node {node.name}"
    cause = f"{words} on {where_words}"
    node_level = repair is Repair.reboot or gpu is None
    silent = rule.signal == "heartbeat_lost"
    named = [gpu] if gpu is not None else []
    usable = (H.healthy.value, H.suspect.value)
    if node_level:
        taking = sum(g.health in usable for g in gpus.values()) if node.health in usable else 0
    else:
        taking = sum(g.health in usable for g in named)
    held = breaker_holds(session, at, taking, now)
    if held is not None:
        inc.held_back = held[:300]
        out.held_back = held
        log.warning("health_breaker_open", node=node.name, incident=str(inc.id), why=held)
        if gpu is not None and gpu.health == H.healthy.value:
            move(session, at, gpu, H.suspect, f"{cause}; {held}", incident=inc, now=now)
        return
    details = {
        "xid": rule.code if rule.signal == "xid" else None,
        "signal": rule.signal,
        "action": rule.action.value,
        "source": rule.source,
    }
    # A fault from before a repair of this hardware began (reported late, asking more than
    # that repair does) is no evidence that the repair did not hold: it escalates the repair.
    older = _repair_began_since(session, node, gpu, latest)
    refault = not older and _repaired_lately(session, node, gpu, latest)
    to_service = repair is Repair.service or (
        gpu is not None and not older and (gpu.health == H.validating.value or refault)
    )
    # Whose work stops: the GPU's, the node's, or the NVLink domain's multi-GPU work.
    stop_scope = "domain" if scope is Scope.domain else "node" if node_level else "gpu"
    stopped = workloads.interrupt_on_fault(
        session,
        node,
        [g.index for g in named] if stop_scope == "gpu" else None,
        stop_scope,
        fault_at,
        cause,
        {**details, "incident": str(inc.id)},
    )
    out.stopped += stopped
    inc.scope = max(Scope[inc.scope], scope).name
    if to_service and gpu is not None and gpu.health != H.out_of_service.value:
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
            taken_out=1 if gpu.health in usable else 0,
        )
    if to_service and gpu is not None:
        inc.repair = max(Repair[inc.repair], Repair.service).name
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
    # Quarantine (or unreachable), drain (the work is already stopped), repair.
    subjects: list[Node | Gpu] = [*([node] if node_level else []), *named]
    for x in subjects:
        if x.health == H.out_of_service.value:
            continue
        first = x.health in usable or x.health == H.validating.value
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


def _silent_since(session: Session, node: Node, since: datetime) -> bool:
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


def _repaired_lately(session: Session, node: Node, gpu: Gpu | None, at: datetime) -> bool:
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


def _repair_began_since(session: Session, node: Node, gpu: Gpu | None, at: datetime) -> bool:
    """Whether a repair of this GPU (or, None, of the node) began at or after `at`."""
    rows = session.execute(
        select(HealthRepair.kind, HealthRepair.gpu_indices).where(
            HealthRepair.node_id == node.id, HealthRepair.started_at >= at
        )
    ).all()
    index = gpu.index if gpu is not None else None
    return any(_repairs(kind, indices, index) is not Repair.none for kind, indices in rows)


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
    for x in subjects:
        move(
            session,
            at,
            x,
            H.repairing,
            f"{what} by the provider, about {seconds:.0f} s",
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
    listed = set(rep.gpu_indices or [])
    subjects: list[Node | Gpu] = [*([node] if node_level else []), *gpus]
    what = {"reboot": "node reboot", "reset": "GPU reset", "return": "node agent's return"}[
        rep.kind
    ]
    if rep.phase == "repairing":
        current = [x for x in subjects if x.health == H.repairing.value]
        if not current:  # moved on meanwhile (an operator, or a worse fault)
            rep.finished_at, rep.outcome = now, "superseded"
            return "superseded"
        if not get_provider(session).repaired(
            str(rep.id),
            rep.kind,  # type: ignore[arg-type]
            node.name,
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
        for x in current:
            move(
                session,
                at,
                x,
                H.validating,
                f"{what} done: validating",
                now=now,
                details={"repair": str(rep.id)},
            )
        rep.phase = "validating"
        seconds = get_settings().validate_seconds
        rep.due_at = now + timedelta(seconds=seconds)
        enqueue(session, "health.repair", queue="health", countdown=seconds, repair_id=str(rep.id))
        return "validating"
    current = [x for x in subjects if x.health == H.validating.value]
    if node_level and node not in current:
        # The node did not pass (it moved on: silent, a worse fault): the GPUs it would carry
        # along wait for its next validation; its own named GPUs are validated as a reset's.
        current = [x for x in current if isinstance(x, Node) or x.index in listed]
    if rep.kind == "reboot" and node in current and _silent_since(session, node, rep.started_at):
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
    for x in current:
        move(
            session,
            at,
            x,
            H.healthy,
            f"validated after the {what}: back in service",
            now=now,
            details={"repair": str(rep.id)},
        )
    rep.phase = "done"
    rep.finished_at, rep.outcome = now, "ok"

    kick_placement(session, at.region)
    return "healthy"


# --- operators' hands ------------------------------------------------------------------------


OPERATOR_ACTIONS = ("quarantine", "release", "retire")


def operator_action(
    session: Session, node: Node, gpu: Gpu | None, action: str, reason: str | None
) -> str:
    """Quarantine, release or retire a GPU (or a whole node) by hand. Quarantine and retire
    stop the work on it now (requeued ahead of its peers: not its owner's doing); release
    returns it to service (through validation when it was out of service or unreachable).
    Returns the new state; a move the table forbids is a 409."""
    at = where(session, node)
    subject: Node | Gpu = gpu if gpu is not None else node
    is_node = gpu is None
    now = utcnow()
    why = f"{action}d by an operator" + (f": {reason}" if reason else "")
    current = Health(subject.health)
    if action == "release":
        if current is H.healthy:
            return current.value  # nothing to release: idempotent
        if current in (H.out_of_service, H.unreachable):
            if is_node and current is H.unreachable:
                # The operator vouches for the node: its agent is expected again once it shows
                # itself by a new stream (else its silence would take the node out again).
                session.execute(
                    update(NodeHeartbeat)
                    .where(NodeHeartbeat.node_id == node.id)
                    .values(agent=False, stream_since=None, stream_beats=0)
                )
            move(session, at, subject, H.validating, why, actor=Actor.operator, now=now)
            start_validation(
                session,
                node,
                [] if is_node else [gpu.index],  # type: ignore[union-attr]
                "return" if is_node else "reset",
                now,
            )
            return subject.health
        move(session, at, subject, H.healthy, why, actor=Actor.operator, now=now)

        kick_placement(session, at.region)
        return subject.health
    to = H.quarantined if action == "quarantine" else H.out_of_service
    if current is to:
        return current.value
    states.check(current, to, Actor.operator, node=is_node)
    workloads.interrupt_on_fault(
        session,
        node,
        None if is_node else [gpu.index],  # type: ignore[union-attr]
        "node" if is_node else "gpu",
        now,
        why,
        {"action": f"operator_{action}", "xid": None, "signal": "operator"},
    )
    move(session, at, subject, to, why, actor=Actor.operator, now=now)
    return subject.health


# --- what operators see -----------------------------------------------------------------------


def summary(session: Session) -> dict[str, Any]:
    """Per region and rack: GPUs by health state and by allocation, and what is out and why;
    open incidents; what the circuit breaker held back within its window."""
    s = get_settings()
    rows = session.execute(
        select(
            Region.name,
            Rack.name,
            Node.name,
            Node.state,
            Node.health,
            Node.health_reason,
            Node.health_since,
            Gpu.index,
            Gpu.health,
            Gpu.health_reason,
            Gpu.health_since,
            func.coalesce(GpuUsage.milli_used, 0),
        )
        .select_from(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .outerjoin(GpuUsage, (GpuUsage.node_id == Gpu.node_id) & (GpuUsage.gpu_index == Gpu.index))
        .where(Node.state != "retired")
        .order_by(Region.name, Rack.name, Node.name, Gpu.index)
    ).all()
    placeable = {h.value for h in states.PLACEABLE}
    regions: dict[str, dict[str, Any]] = {}
    seen_nodes: set[str] = set()
    for (
        region,
        rack,
        node,
        nstate,
        nhealth,
        nreason,
        nsince,
        index,
        ghealth,
        greason,
        gsince,
        used,
    ) in rows:
        reg = regions.setdefault(
            region,
            {"region": region, "gpus": 0, "by_health": {}, "by_allocation": _alloc0(), "racks": {}},
        )
        rk = reg["racks"].setdefault(
            rack, {"rack": rack, "gpus": 0, "by_health": {}, "by_allocation": _alloc0(), "out": []}
        )
        # A GPU's effective state: its node's when the node is out.
        health = ghealth if nhealth in placeable else nhealth
        usable = nstate == "ready" and nhealth in placeable and ghealth in placeable
        alloc = "allocated" if used > 0 else "idle" if usable else "unavailable"
        for agg in (reg, rk):
            agg["gpus"] += 1
            agg["by_health"][health] = agg["by_health"].get(health, 0) + 1
            agg["by_allocation"][alloc] += 1
        if nhealth not in placeable and node not in seen_nodes:
            seen_nodes.add(node)
            rk["out"].append(
                {
                    "node": node,
                    "gpu_index": None,
                    "health": nhealth,
                    "reason": nreason,
                    "since": nsince,
                }
            )
        elif nhealth in placeable and ghealth != "healthy":
            rk["out"].append(
                {
                    "node": node,
                    "gpu_index": index,
                    "health": ghealth,
                    "reason": greason,
                    "since": gsince,
                }
            )
    since = utcnow() - timedelta(seconds=s.breaker_window_seconds)
    incidents = session.scalars(
        select(HealthIncident)
        .where((HealthIncident.state == IncidentState.open) | (HealthIncident.opened_at >= since))
        .order_by(HealthIncident.opened_at.desc())
        .limit(200)
    ).all()
    names: dict[uuid.UUID, str] = {}
    if incidents:
        ids = {i.node_id for i in incidents}
        names = {
            k: v for k, v in session.execute(select(Node.id, Node.name).where(Node.id.in_(ids)))
        }
    return {
        "regions": [{**r, "racks": list(r["racks"].values())} for r in regions.values()],
        "incidents": [
            {
                "id": i.id,
                "node": names.get(i.node_id),
                "region": i.region,
                "state": i.state,
                "opened_at": i.opened_at,
                "last_signal_at": i.last_signal_at,
                "signal": i.signal,
                "xid": i.code if i.signal == "xid" else None,
                "action": i.action,
                "what": i.what,
                "gpu_indices": i.gpu_indices,
                "signals": i.signal_count,
                "held_back": i.held_back,
            }
            for i in incidents
        ],
    }


def _alloc0() -> dict[str, int]:
    return {"allocated": 0, "idle": 0, "unavailable": 0}


def history(session: Session, node: Node, gpu_index: int | None, limit: int) -> list[HealthEvent]:
    """A node's (or one of its GPUs') health transitions, newest first."""
    stmt = select(HealthEvent).where(HealthEvent.node_id == node.id)
    if gpu_index is not None:
        stmt = stmt.where(HealthEvent.gpu_index == gpu_index)
    return list(session.scalars(stmt.order_by(HealthEvent.id.desc()).limit(limit)))


def report_step_times(
    session: Session, w: Any, step_s: dict[int, float]
) -> tuple[list[int], list[int], bool]:
    """A running workload's per-rank step times: a rank slower than the gang's median points at
    its GPU, whose speed score goes down to what the times imply (evidence, dated now: it fades
    back without more). Rank r is GPU r % gpus of replica r // gpus. A workload on a shared GPU
    (time-slicing, MPS) has one rank, judged against its own best pace: a noisy neighbour.
    Returns the slow ranks, those the workload does not have (ignored), and whether a noisy
    neighbour was found."""
    if w.state != State.running.value:
        raise NotRunning(f"A {w.state} workload has no ranks to report.", state=w.state)
    per = w.shape.gpus
    if per < 1 and w.shape.milli:
        unknown = sorted(r for r in step_s if r >= 1)
        return [], unknown, 0 in step_s and shared_pace(session, w, step_s[0])
    if per < 1:
        raise NoRanks(
            "Step times are for workloads of whole GPUs; this one runs on a share or a MIG slice.",
            shape=w.shape.mig_profile or "fractional",
        )
    total = per * w.replicas
    unknown = sorted(r for r in step_s if r >= total)
    step_s = {r: t for r, t in step_s.items() if r < total}
    allocs = {
        a.replica: a
        for a in session.scalars(
            select(Allocation).where(
                Allocation.workload_id == w.id, Allocation.released_at.is_(None)
            )
        )
    }
    scores = from_step_times(step_s)
    slow = sorted(r for r, v in scores.items() if worth_writing(1.0, v))
    now = utcnow()
    for r in slow:
        a = allocs.get(r // per)
        if a is None or r % per >= len(a.gpu_indices):
            continue
        gpu = session.scalar(
            select(Gpu)
            .where(Gpu.node_id == a.node_id, Gpu.index == a.gpu_indices[r % per])
            .with_for_update()
        )
        if gpu is not None and worth_writing(float(gpu.perf), min(float(gpu.perf), scores[r])):
            gpu.perf = min(float(gpu.perf), scores[r])
            gpu.perf_at = now
        elif gpu is not None:
            gpu.perf_at = now  # the same evidence again: it does not fade yet
    return slow, unknown, False


# A step time this many times the workload's best, on a GPU this busy, shared with other work:
# a noisy neighbour (not the hardware: the GPU's speed score is left alone).
NOISY_SLOWDOWN = 1.5
NOISY_UTIL = 90.0


def shared_pace(session: Session, w: Any, step_s: float) -> bool:
    """Judge a shared GPU's workload by its own best pace. Slowed down while the GPU it shares
    is saturated: tell the owner (an event naming the neighbours, which the isolation tiers
    keep within its tenant), never place it on that GPU again, and, if it checkpoints, move it
    at its next checkpoint. Returns whether a noisy neighbour was found."""
    best = w.step_time_best_s
    if best is None or step_s < best:
        w.step_time_best_s = step_s
        return False
    if step_s < NOISY_SLOWDOWN * best:
        return False
    a = session.scalar(
        select(Allocation).where(Allocation.workload_id == w.id, Allocation.released_at.is_(None))
    )
    if a is None or not a.gpu_indices:
        return False
    index = a.gpu_indices[0]
    # The node's live allocations are few: the GPU's sharers are picked out here.
    others = [
        (wid, tenant)
        for wid, tenant, gpus in session.execute(
            select(Workload.id, Workload.tenant_id, Allocation.gpu_indices)
            .join(Allocation, Allocation.workload_id == Workload.id)
            .where(
                Allocation.node_id == a.node_id,
                Allocation.released_at.is_(None),
                Workload.id != w.id,
                Workload.state == "running",
            )
        )
        if index in (gpus or ())
    ]
    if not others:
        return False
    node = session.get(Node, a.node_id)
    gpu = session.scalar(select(Gpu).where(Gpu.node_id == a.node_id, Gpu.index == index))
    if node is None or gpu is None:
        return False
    # Read from the table, not the session's copy: telemetry writes it with Core statements.
    latest = session.scalar(select(GpuTelemetry.latest).where(GpuTelemetry.gpu_id == gpu.id))
    util = (latest or {}).get("util")
    if util is None or util < NOISY_UTIL:
        return False
    where_ = [node.name, index]
    if where_ in (w.avoid_gpus or []):
        return True  # told already
    mine = sorted(str(o[0]) for o in others if o[1] == w.tenant_id)
    words = (
        f"noisy neighbour: GPU {index} of {node.name} is saturated ({util:.0f}% busy) and this "
        f"workload's step time is {step_s / best:.1f}x its best; "
        + (f"workload {mine[0]} of your tenant shares it" if mine else "other work shares it")
    )
    w.avoid_gpus = [*(w.avoid_gpus or []), where_]
    tell_owner(
        session,
        w,
        words,
        {
            "reason": "noisy_neighbour",
            "node": node.name,
            "gpu": index,
            "neighbours": mine,
            "slowdown": round(step_s / best, 3),
            "util": util,
        },
        move_to="another GPU",
    )
    return True


class NoRanks(Conflict):
    code = "workload_has_no_ranks"
    title = "The workload has no ranks"


def act(session: Session, node: Node, gpu: Gpu | None, action: str, reason: str | None) -> dict:
    """An operator's quarantine, release or retire of a node or one of its GPUs, answered as
    REST and GraphQL show it."""
    health = operator_action(session, node, gpu, action, reason)
    return {"node_id": node.id, "gpu_index": gpu.index if gpu else None, "health": health}
