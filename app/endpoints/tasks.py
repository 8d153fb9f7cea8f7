"""The endpoints' controller as a beat task: one tick a second, one transaction per region
(under the region's lock, so two workers never decide for one endpoint at once)."""

from __future__ import annotations

from celery import shared_task

from app.core.db import RETRY_DB, session_scope, utcnow
from app.core.logging import get_logger
from app.endpoints import controller

log = get_logger(__name__)


@shared_task(name="endpoints.autoscale", ignore_result=True, autoretry_for=RETRY_DB, max_retries=3)
def autoscale() -> int:
    """Decide every endpoint's target and bring its replicas to it; the endpoints decided."""
    with session_scope() as session:
        regions = controller.regions(session)
    decided = 0
    for region in regions:
        with session_scope() as session:
            report = controller.tick(session, region, utcnow())
        decided += report.endpoints
        if report.scaled or report.submitted or report.terminated:
            log.info(
                "endpoints_scaled",
                region=region,
                scaled=report.scaled,
                submitted=report.submitted,
                terminated=report.terminated,
            )
    return decided
