from __future__ import annotations

from fastapi import Depends

from app.chaos import service
from app.chaos.inject import stop
from app.chaos.report import experiment_view
from app.chaos.schemas import ExperimentIn, ExperimentOut, ExperimentState, ExperimentSummaryOut
from app.core.db import get_or_404
from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams
from app.models.chaos import ChaosExperiment
from app.tenancy.auth import Platform

admin = api_router(prefix="/v1/admin/chaos", tags=["admin: chaos"])


@admin.post(
    "/experiments",
    status_code=201,
    response_model=ExperimentOut,
    summary="Start a chaos experiment: faults injected through telemetry, within a blast radius",
    description=(
        "Off unless RACKPLANE_CHAOS_ENABLED (403 chaos_disabled). The faults' targets are "
        "resolved and checked against the blast radius (409 blast_radius_exceeded) before "
        "anything is injected; then they arrive as dcgm-exporter would report them (now, or "
        "per the schedule: each round is checked again, with what earlier rounds touched)."
    ),
)
def start_experiment(body: ExperimentIn, auth: Platform, session: DbSession) -> dict:
    exp = service.start(session, body)
    return experiment_view(session, exp)


@admin.get(
    "/experiments",
    response_model=Page[ExperimentSummaryOut],
    summary="List chaos experiments, oldest first (each one's report: GET .../{experiment_id})",
)
def list_experiments(
    *,
    state: ExperimentState | None = None,
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = service.list_experiments(session, page, state=state.value if state else None)
    return {"items": items, "next_cursor": nxt}


@admin.get(
    "/experiments/{experiment_id}",
    response_model=ExperimentOut,
    summary="A chaos experiment and its report: times to detect, quarantine, requeue, run",
)
def read_experiment(experiment_id: str, auth: Platform, session: DbSession) -> dict:
    return experiment_view(
        session, get_or_404(session, ChaosExperiment, experiment_id, what="experiment")
    )


@admin.post(
    "/experiments/{experiment_id}/stop",
    response_model=ExperimentOut,
    summary="Stop a chaos experiment and undo what it injected",
)
def stop_experiment(experiment_id: str, auth: Platform, session: DbSession) -> dict:
    exp = get_or_404(session, ChaosExperiment, experiment_id, what="experiment", for_update=True)
    stop(session, exp)
    return experiment_view(session, exp)
