from __future__ import annotations

from datetime import timedelta

from celery import shared_task

from app.outbox.service import send


@shared_task(name="outbox.drain", ignore_result=True)
def drain() -> int:
    """Reconciler: send outbox messages whose immediate dispatch did not happen."""
    return send(older_than=timedelta(seconds=10))
