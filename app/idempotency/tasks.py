from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from sqlalchemy import delete

from app.core.config import get_settings
from app.core.db import session_scope, utcnow
from app.models.idempotency import IdempotencyRecord


@shared_task(name="idempotency.purge", ignore_result=True)
def purge() -> int:
    """Reconciler: forget Idempotency-Key results older than the configured TTL."""
    cutoff = utcnow() - timedelta(hours=get_settings().idempotency_ttl_hours)
    with session_scope() as session:
        result = session.execute(
            delete(IdempotencyRecord).where(IdempotencyRecord.created_at < cutoff)
        )
        return result.rowcount or 0
