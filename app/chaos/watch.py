"""The watch loop: rounds of scheduled and repeating experiments when they are due, and the abort
conditions of running ones."""

from __future__ import annotations

import random
import uuid

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.chaos.inject import fire_round, stop
from app.chaos.schemas import ExperimentIn
from app.chaos.targets import BlastRadiusExceeded, NotEnoughTargets, UnknownTarget, plan_round
from app.core.db import utcnow
from app.models.chaos import ChaosExperiment
from app.models.fleet import Gpu, Node
from app.models.health import PLACEABLE
from app.models.workloads import GpuUsage, Workload


def fire_due(session: Session) -> list[uuid.UUID]:
    """Run the rounds of scheduled and repeating experiments that are due. A round whose
    targets would pass the blast radius (with what earlier rounds touched) aborts the
    experiment instead. Returns the experiments that ran a round."""
    now = utcnow()
    fired = []
    for exp in session.scalars(
        select(ChaosExperiment)
        .where(ChaosExperiment.state.in_(("scheduled", "running")), ChaosExperiment.next_at <= now)
        .with_for_update(skip_locked=True)
    ):
        # Claim the round: an experiment stopped meanwhile (SQLite has no row locks) is left be.
        claimed = session.execute(
            update(ChaosExperiment)
            .where(
                ChaosExperiment.id == exp.id,
                ChaosExperiment.state == exp.state,
                ChaosExperiment.rounds == exp.rounds,
            )
            .values(next_at=None)
            .execution_options(synchronize_session=False)
        ).rowcount
        if claimed != 1:
            continue
        body = ExperimentIn.model_validate(exp.spec)
        try:
            with session.begin_nested():
                plan, touched = plan_round(
                    session, body, random.Random(exp.id.int + exp.rounds), exp.touched or {}
                )
                if exp.state == "scheduled":
                    exp.state, exp.started_at = "running", now
                fire_round(session, exp, body, plan, touched, now)
        except (BlastRadiusExceeded, NotEnoughTargets, UnknownTarget) as e:
            stop(session, exp, abort_reason=f"round {exp.rounds + 1}: {e.detail}")
            continue
        fired.append(exp.id)
    return fired


def check_aborts(session: Session) -> list[uuid.UUID]:
    """Abort every running experiment whose abort condition holds now. Returns their ids."""
    aborted = []
    for exp in session.scalars(
        select(ChaosExperiment).where(ChaosExperiment.state == "running").with_for_update()
    ):
        cond = (exp.spec or {}).get("abort") or {}
        why = None
        limit = cond.get("max_failed_workloads")
        if limit is not None:
            failed = session.scalar(
                select(func.count(Workload.id)).where(
                    Workload.state == "failed", Workload.finished_at >= exp.started_at
                )
            )
            if failed > limit:
                why = f"{failed} workloads failed since it started (the limit is {limit})"
        floor = cond.get("min_idle_gpus")
        if why is None and floor is not None:
            placeable = [h.value for h in PLACEABLE]
            idle = session.scalar(
                select(func.count(Gpu.id))
                .join(Node, Gpu.node_id == Node.id)
                .outerjoin(
                    GpuUsage,
                    (GpuUsage.node_id == Gpu.node_id) & (GpuUsage.gpu_index == Gpu.index),
                )
                .where(
                    Node.state == "ready",
                    Node.health.in_(placeable),
                    Gpu.health.in_(placeable),
                    func.coalesce(GpuUsage.milli_used, 0) == 0,
                )
            )
            if idle < floor:
                why = f"{idle} idle healthy GPUs left (the floor is {floor})"
        if why is not None:
            stop(session, exp, abort_reason=why)
            aborted.append(exp.id)
    return aborted
