"""A workload's run starting: the provider (simulated or the nodes' agents) says it is up."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from app.core.db import as_aware
from app.models.workloads import Workload
from app.outbox.service import enqueue
from app.scheduling import lifecycle
from app.scheduling.lifecycle import State
from app.scheduling.providers import Provider


def start(session: Session, ws: list[Workload], at: datetime, provider: Provider) -> None:
    """`ws` (provisioning, locked by the caller) run from `at`; each is stopped at its deadline
    (`workloads.expire`) unless its process ends first."""
    if not ws:
        return
    for w in ws:
        lifecycle.transition(
            session, w, State.running, "the provider reports it up", at=at, flush=False
        )
        w.run_deadline_at = run_deadline(w, at, provider)
    lifecycle.write(session, ws)
    _expire_later(session, {str(w.id): w.run_deadline_at for w in ws}, at)


def run_deadline(w: Workload, start: datetime, provider: Provider) -> datetime:
    """When the run that starts at `start` ends at the latest: its max_runtime_s, or sooner
    when the provider knows its process exits by itself (the simulated run)."""
    seconds = float(w.max_runtime_s)
    exits = provider.run_for(w)
    if exits is not None:
        seconds = min(seconds, exits)
    return start + timedelta(seconds=seconds)


def _expire_later(session: Session, deadlines: dict[str, datetime | None], now: datetime) -> None:
    """One `workloads.expire` per deadline second for the workloads due then."""
    due: dict[float, list[str]] = {}
    for wid, deadline in deadlines.items():
        if deadline is None:
            continue
        step = max(0.0, math.ceil((as_aware(deadline) - now).total_seconds()))
        due.setdefault(step, []).append(wid)
    for step, ids in sorted(due.items()):
        enqueue(session, "workloads.expire", queue="provisioning", countdown=step, workload_ids=ids)
