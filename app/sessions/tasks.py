from __future__ import annotations

from celery import shared_task

from app.core.db import session_scope
from app.sessions import service


@shared_task(name="sessions.purge", ignore_result=True)
def purge() -> int:
    """Reconciler: forget browser sessions that ended more than a day ago."""
    with session_scope() as session:
        return service.purge(session)
