"""Transactional outbox: tasks are recorded with the change that needs them and sent to
Celery only after that change commits (immediately when possible, else by the beat drainer)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from app.core.db import as_aware, get_sessionmaker, utcnow
from app.core.logging import get_logger
from app.outbox.models import OutboxMessage

log = get_logger(__name__)
_PENDING = "rackplane_outbox_pending"


def enqueue(
    session: Session, task: str, *, queue: str, countdown: float = 0.0, **kwargs: Any
) -> OutboxMessage:
    """Record `task(**kwargs)` to be sent once the session's transaction commits (to run no
    earlier than `countdown` seconds from now)."""
    now = utcnow()
    eta = now + timedelta(seconds=countdown) if countdown > 0 else None
    msg = OutboxMessage(task=task, kwargs=kwargs, queue=queue, eta=eta, created_at=now)
    session.add(msg)
    session.flush()
    session.info.setdefault(_PENDING, []).append(msg.id)
    return msg


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    ids = session.info.pop(_PENDING, None)
    if ids:
        session.info.setdefault("rackplane_outbox_committed", []).extend(ids)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)


def flush_committed(session: Session) -> None:
    """Send what the session committed. Called by the unit-of-work wrappers after commit."""
    ids = session.info.pop("rackplane_outbox_committed", None)
    if ids:
        try:
            send(ids)
        except Exception as exc:  # the beat drainer will retry; the change itself is committed
            log.warning("outbox_send_deferred", ids=ids, error=str(exc))


def send(
    ids: list[int] | None = None, *, older_than: timedelta | None = None, limit: int = 500
) -> int:
    """Send unsent messages (the given ids, or all older than `older_than`). Returns how many."""
    from workers.celery_app import celery_app

    sent = 0
    with get_sessionmaker()() as session:
        stmt = select(OutboxMessage).where(OutboxMessage.sent_at.is_(None))
        if ids is not None:
            stmt = stmt.where(OutboxMessage.id.in_(ids))
        if older_than is not None:
            stmt = stmt.where(OutboxMessage.created_at <= utcnow() - older_than)
        stmt = stmt.order_by(OutboxMessage.id).limit(limit)
        if session.get_bind().dialect.name == "postgresql":
            stmt = stmt.with_for_update(skip_locked=True)
        for msg in session.scalars(stmt):
            msg.attempts += 1
            try:
                celery_app.send_task(
                    msg.task,
                    kwargs=msg.kwargs,
                    queue=msg.queue,
                    eta=as_aware(msg.eta) if msg.eta is not None else None,
                    retry=True,
                    retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
                )
            except Exception as exc:
                msg.last_error = str(exc)[:1000]
                session.commit()
                raise
            msg.sent_at = utcnow()
            sent += 1
        session.commit()
    return sent
