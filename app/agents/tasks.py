"""Beat tasks of the agents' domain."""

from __future__ import annotations

from celery import shared_task

from app.agents import miglayout
from app.core.db import session_scope, utcnow
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
