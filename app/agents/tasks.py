"""Beat tasks of the agents' domain."""

from __future__ import annotations

import uuid
from datetime import datetime

from celery import shared_task

from app.agents import miglayout, runs
from app.core.db import RETRY_DB, session_scope, utcnow
from app.core.logging import get_logger

log = get_logger(__name__)


@shared_task(name="agents.mig_layouts", ignore_result=True)
def mig_layouts() -> dict:
    """Beat: each region's MIG layouts brought in line with what its queue waits for
    (RACKPLANE_MIG_RELAYOUT; app/agents/miglayout.py)."""
    asked: dict[str, int] = {}
    with session_scope() as session:
        names = miglayout.regions(session)
    for region in names:
        with session_scope() as session:
            asked[region] = miglayout.advance(session, region, utcnow())
    if any(asked.values()):
        log.info("mig_layouts", **asked)
    return asked


@shared_task(
    name="agents.judge_gang",
    ignore_result=True,
    autoretry_for=RETRY_DB,
    retry_backoff=True,
    max_retries=20,
)
def judge_gang(workload_id: str, attempt: int, reason: str, at: str, details: dict) -> str:
    """A gang's replica failed while its other hosts were silent: theirs or its fault
    (app/agents/runs.py `judge_gang`)."""
    with session_scope() as session:
        out = runs.judge_gang(
            session, uuid.UUID(workload_id), attempt, reason, datetime.fromisoformat(at), details
        )
    log.info("judge_gang", workload_id=workload_id, attempt=attempt, outcome=out)
    return out
