"""Evaluation: a node's new fault signals (from telemetry, or a lost heartbeat) into its
incident, and the incident into actions. Signals group into the node's incident (a burst:
signals until the window passes without one); the incident is classified by its worst row
(`actions.py`), and what it now asks beyond what was already done is carried out GPU by GPU
(`response.py`). A fault is acted on once (`_news`)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.health import actions
from app.health.actions import Repair, Rule, Scope
from app.health.classify import describe, rule_from_incident, rule_of
from app.health.repairs import answers, repair_done_by
from app.health.response import Outcome, notify_or_watch, take_out
from app.health.states import Actor
from app.health.transitions import H, Where, where
from app.models.fleet import Gpu, Node
from app.models.health import (
    HealthEvent,
    HealthIncident,
    HealthRepair,
    IncidentState,
    NodeHeartbeat,
)

MAX_KEPT_SIGNALS = 20


def evaluate(session: Session, node_id: uuid.UUID, signals: list[dict[str, Any]]) -> Outcome:
    """Take a node's new signals into its incident and carry out what the incident asks."""
    node = session.scalar(select(Node).where(Node.id == node_id).with_for_update())
    if node is None or not signals:
        return Outcome()
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
    rules = [rule_of(sig) for sig in signals]
    inc = _take_in(session, at, inc, signals, rules, now)
    out = Outcome(incident=inc.id, action=inc.action)
    _carry_out(session, at, inc, signals, rules, now, out)
    return out


def _take_in(
    session: Session,
    at: Where,
    inc: HealthIncident | None,
    signals: list[dict[str, Any]],
    rules: list[Rule],
    now: datetime,
) -> HealthIncident:
    """The incident the signals (sorted, news) join: the latest one if they fall within its
    window (reopened if the sweep closed it), else a new one. Its class moves to the worst row
    seen; the first MAX_KEPT_SIGNALS signals and every GPU named are kept."""
    first = _instant(signals[0]["at"], now)
    last = _instant(signals[-1]["at"], now)
    window = timedelta(seconds=get_settings().incident_window_seconds)
    if inc is not None and first - as_aware(inc.last_signal_at) > window:
        if inc.state == IncidentState.open:
            inc.state, inc.closed_at = IncidentState.closed, as_aware(inc.last_signal_at) + window
        inc = None
    elif inc is not None and inc.state != IncidentState.open:
        inc.state, inc.closed_at = IncidentState.open, None
    new_worst = actions.worst(rules)
    if inc is None:
        inc = HealthIncident(
            id=uuid.uuid4(),
            node_id=at.node.id,
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
        old = rule_from_incident(inc)
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
    return inc


def _carry_out(
    session: Session,
    at: Where,
    inc: HealthIncident,
    signals: list[dict[str, Any]],
    rules: list[Rule],
    now: datetime,
    out: Outcome,
) -> None:
    """What the new signals ask, GPU by GPU (a node-level signal names no GPU)."""
    first = _instant(signals[0]["at"], now)
    gpus = {
        g.index: g
        for g in session.scalars(
            select(Gpu).where(Gpu.node_id == at.node.id).order_by(Gpu.index).with_for_update()
        )
    }
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
            notify_or_watch(session, at, inc, gpu, worst, now, out)
            continue
        take_out(
            session, at, inc, gpu, gpus, worst, scope, repair, fault_at, latest[index], now, out
        )


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
            as_aware(started) >= at and answers(repair_done_by(kind, indices, index), need)
            for kind, indices, started in repairs
        ):
            continue
        out.append(sig)
    return out


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
