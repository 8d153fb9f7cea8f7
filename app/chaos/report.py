"""An experiment's report: per fault, when the health loop detected it, took the hardware out,
requeued the work and ran it again; the work lost; and whether the invariants held."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.chaos.invariants import invariants
from app.core.db import as_aware
from app.models.chaos import ChaosExperiment, ChaosInjection
from app.models.health import HealthEvent, HealthIncident
from app.models.workloads import WorkloadEvent

OUT_STATES = ("quarantined", "unreachable", "out_of_service", "suspect")


def report(session: Session, exp: ChaosExperiment) -> dict[str, Any]:
    """Per fault: when the loop detected it, took the hardware out, requeued the work and ran
    it again; the work lost; and the invariants over the experiment's history."""
    injections = list(
        session.scalars(
            select(ChaosInjection)
            .where(ChaosInjection.experiment_id == exp.id)
            .order_by(ChaosInjection.node, ChaosInjection.gpu_index)
        )
    )
    started = as_aware(exp.started_at)
    events = session.scalars(
        select(WorkloadEvent).where(WorkloadEvent.at >= started, WorkloadEvent.kind == "transition")
    ).all()
    faults, affected = [], {}
    for inj in injections:
        faults.append(_fault_row(session, inj, events, affected))
    inv = invariants(session, started, events, affected)
    return {
        "report": faults,
        "invariants": inv,
        "held": not any(inv.values()),
        "injections": injections,
    }


def _fault_row(
    session: Session, inj: ChaosInjection, events, affected: dict[uuid.UUID, datetime]
) -> dict[str, Any]:
    """One fault's line of the report. The work it stopped is added to `affected` (with when
    it was stopped), for the invariants."""
    at = as_aware(inj.injected_at)
    inc = session.scalar(
        select(HealthIncident)
        .where(HealthIncident.node_id == inj.node_id, HealthIncident.last_signal_at >= at)
        .order_by(HealthIncident.last_signal_at)
        .limit(1)
    )
    row: dict[str, Any] = {
        "injection": inj.id,
        "node": inj.node,
        "gpu_index": inj.gpu_index,
        "incident": inc.id if inc else None,
        "action": inc.action if inc else None,
        "detect_s": None,
        "quarantine_s": None,
        "requeue_s": None,
        "running_s": None,
        "workloads": [],
        "lost_work_gpu_s": 0.0,
    }
    if inc is not None:
        _incident(session, row, at, inc, events, affected)
    if inj.kind == "provider" and inj.detail == "boot":
        _boot_failures(row, at, inj.node, events)
    if inj.kind == "noisy_neighbour":
        _noisy(session, row, at, inj, events)
    return row


def _incident(
    session: Session,
    row: dict[str, Any],
    at: datetime,
    inc: HealthIncident,
    events,
    affected: dict[uuid.UUID, datetime],
) -> None:
    """What the health loop did about the fault's incident: when it first acted, took the
    hardware out, requeued the work it stopped, and when all of that work ran again."""
    hev = session.scalars(
        select(HealthEvent).where(HealthEvent.incident_id == inc.id).order_by(HealthEvent.id)
    ).all()
    mine = [e for e in events if (e.details or {}).get("incident") == str(inc.id)]
    acted = [as_aware(e.at) for e in hev] + [as_aware(e.at) for e in mine]
    row["detect_s"] = _since(at, min(acted)) if acted else None
    out = [as_aware(e.at) for e in hev if e.to_state in OUT_STATES]
    row["quarantine_s"] = _since(at, min(out)) if out else None
    stopped = {e.workload_id: e for e in mine if e.to_state == "preempted"}
    queued = [as_aware(e.at) for e in mine if e.to_state == "queued"]
    row["requeue_s"] = _since(at, max(queued)) if queued else None
    again = []
    for wid, e in stopped.items():
        ran = _ran_again(events, wid, e.seq)
        if ran is not None:
            again.append(ran)
        affected[wid] = as_aware(e.at)
        row["lost_work_gpu_s"] += float((e.details or {}).get("lost_work_gpu_s") or 0)
    row["running_s"] = _since(at, max(again)) if again and len(again) == len(stopped) else None
    row["workloads"] = sorted(stopped)


def _boot_failures(row: dict[str, Any], at: datetime, node: str, events) -> None:
    """A node that fails to boot: the work that failed there (back in the queue at once), and
    when all of it ran again (elsewhere, or there once the experiment stopped)."""
    failed = [
        e
        for e in events
        if e.to_state == "queued"
        and e.reason.startswith("provisioning failed")
        and node in (e.details or {}).get("nodes", ())
        and as_aware(e.at) >= at
    ]
    if not failed:
        return
    first = {}
    for e in failed:
        first.setdefault(e.workload_id, e)
    row["detect_s"] = _since(at, min(as_aware(e.at) for e in failed))
    row["requeue_s"] = _since(at, max(as_aware(e.at) for e in failed))
    again = []
    last = {wid: max(e.seq for e in failed if e.workload_id == wid) for wid in first}
    for wid, seq in last.items():
        ran = _ran_again(events, wid, seq)
        if ran is not None:
            again.append(ran)
    row["running_s"] = _since(at, max(again)) if again and len(again) == len(last) else None
    row["workloads"] = sorted(first)


def _noisy(session: Session, row: dict[str, Any], at: datetime, inj, events) -> None:
    """A noisy neighbour: the victims told (and when), moved at their checkpoint (and when),
    and running again elsewhere."""
    told = [
        e
        for e in session.scalars(
            select(WorkloadEvent).where(WorkloadEvent.at >= at, WorkloadEvent.kind == "health")
        )
        if (e.details or {}).get("reason") == "noisy_neighbour"
        and (e.details or {}).get("node") == inj.node
        and (e.details or {}).get("gpu") == inj.gpu_index
    ]
    if not told:
        return
    victims = {e.workload_id for e in told}
    row["action"] = "tell the owner; move at checkpoint"
    row["detect_s"] = _since(at, min(as_aware(e.at) for e in told))
    moved = [
        e
        for e in events
        if e.workload_id in victims
        and e.to_state == "preempted"
        and (e.details or {}).get("reason") == "noisy_neighbour"
    ]
    if moved:
        row["requeue_s"] = _since(at, max(as_aware(e.at) for e in moved))
        again = []
        for m in moved:
            ran = _ran_again(events, m.workload_id, m.seq)
            if ran is not None:
                again.append(ran)
        row["running_s"] = _since(at, max(again)) if len(again) == len(moved) else None
        row["lost_work_gpu_s"] = sum(
            float((e.details or {}).get("lost_work_gpu_s") or 0) for e in moved
        )
    row["workloads"] = sorted(victims)


def _ran_again(events, workload_id: uuid.UUID, after_seq: int) -> datetime | None:
    """When the workload next ran after its event `after_seq`, if it did."""
    run = [
        e.at
        for e in events
        if e.workload_id == workload_id and e.to_state == "running" and e.seq > after_seq
    ]
    return as_aware(min(run)) if run else None


def _since(a: datetime, b: datetime) -> float:
    return round((b - a).total_seconds(), 3)


def experiment_view(session: Session, exp: ChaosExperiment) -> dict:
    """An experiment with its report, as REST, GraphQL and the CLI show it."""
    r = report(session, exp)
    return {
        "id": exp.id,
        "name": exp.name,
        "state": exp.state,
        "rounds": exp.rounds,
        "next_at": exp.next_at,
        "abort_reason": exp.abort_reason,
        "gpus_touched": exp.gpus_touched,
        "started_at": exp.started_at,
        "stopped_at": exp.stopped_at,
        "injections": r["injections"],
        "report": r["report"],
        "invariants": r["invariants"],
        "held": r["held"],
    }
