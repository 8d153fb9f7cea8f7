from __future__ import annotations

from celery import shared_task

from app.core.db import session_scope
from app.logs import service


@shared_task(name="logs.prune", ignore_result=True)
def prune() -> int:
    """Reconciler: delete workload log chunks older than `log_retention_hours`."""
    with session_scope() as session:
        return service.prune(session)
