"""Chaos experiments: inject faults through the telemetry path, as dcgm-exporter would report
them, within a blast radius; report what the health loop did and whether the invariants held.

An experiment never writes health states or allocations: its faults are samples handed to the
same ingest as node agents' (`app.health.telemetry.ingest`), in the experiment's transaction.

Starting and listing experiments live here; the rest is in `targets` (what a round hits, the
blast radius), `inject` (a round's faults, and `stop`), `watch` (due rounds, abort
conditions), `report` and `invariants`. Callers import each name from where it is defined."""

from __future__ import annotations

import random
import uuid
from datetime import UTC

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.chaos.inject import fire_round
from app.chaos.schemas import ExperimentIn
from app.chaos.targets import (
    ChaosDisabled,
    plan_round,
)
from app.core.config import get_settings
from app.core.db import utcnow
from app.core.schemas import PageParams, paginate
from app.models.chaos import ChaosExperiment


def start(session: Session, body: ExperimentIn) -> ChaosExperiment:
    """Check the experiment against its blast radius, then inject its faults now, or schedule
    them (at a time, and again every so often)."""
    if not get_settings().chaos_enabled:
        raise ChaosDisabled(
            "Chaos experiments are off on this deployment; set RACKPLANE_CHAOS_ENABLED=true."
        )
    exp_id = uuid.uuid4()
    plan, touched = plan_round(session, body, random.Random(exp_id.int), {})
    now = utcnow()
    sched = body.schedule
    first = sched.at.astimezone(UTC) if sched is not None and sched.at is not None else None
    later = first is not None and first > now
    exp = ChaosExperiment(
        id=exp_id,
        name=body.name,
        state="scheduled" if later else "running",
        spec=body.model_dump(mode="json"),
        gpus_touched=0,
        started_at=now,
        created_at=now,
        next_at=first if later else None,
    )
    session.add(exp)
    session.flush()
    audit.record_system(
        session,
        "chaos.start",
        [
            (
                None,
                "chaos_experiment",
                exp.id,
                {},
                {
                    "name": exp.name,
                    "faults": [f.model_dump(mode="json") for f in body.faults],
                    "blast_radius": body.blast_radius.model_dump(),
                    "schedule": sched.model_dump(mode="json") if sched else None,
                },
            )
        ],
    )
    if not later:
        fire_round(session, exp, body, plan, touched, now)
    return exp


def list_experiments(
    session: Session, page: PageParams, *, state: str | None = None
) -> tuple[list[ChaosExperiment], str | None]:
    """Experiments, oldest first (a page of them), optionally in one state."""
    stmt = select(ChaosExperiment)
    if state is not None:
        stmt = stmt.where(ChaosExperiment.state == state)
    return paginate(session, stmt, ChaosExperiment, page)
