"""Transactional outbox: tasks are recorded with the change that needs them and sent to
Celery only after that change commits (immediately when possible, else by the beat drainer)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import event, insert, select, update
from sqlalchemy.orm import Session

from app.core.broker import get_celery
from app.core.db import after_commit, as_aware, get_sessionmaker, utcnow
from app.core.logging import get_logger
from app.models.outbox import OutboxMessage

log = get_logger(__name__)
_PENDING = "rackplane_outbox_pending"
# After a failed send, requests stop trying the broker for this long (each try costs them up to
# a second of connection retries); what they commit meanwhile waits for the drainer.
BREAKER_SECONDS = 2.0
_breaker = {"open_until": 0.0}


def enqueue(
    session: Session, task: str, *, queue: str, countdown: float = 0.0, **kwargs: Any
) -> None:
    """Record `task(**kwargs)` to be sent once the session's transaction commits (to run no
    earlier than `countdown` seconds from now)."""
    now = utcnow()
    eta = now + timedelta(seconds=countdown) if countdown > 0 else None
    table = OutboxMessage.__table__
    # Core, not the unit of work: one cached INSERT ... RETURNING instead of a flush.
    mid = session.execute(
        insert(table).returning(table.c.id),
        {"task": task, "kwargs": kwargs, "queue": queue, "eta": eta, "created_at": now},
    ).scalar_one()
    session.info.setdefault(_PENDING, []).append((mid, task, kwargs, queue, eta))


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    ids = session.info.pop(_PENDING, None)
    if ids:
        session.info.setdefault("rackplane_outbox_committed", []).extend(ids)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)


class _NoResult:
    """What `publish` asks Celery to return instead of an AsyncResult."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5}


def publish(
    task: str,
    *,
    kwargs: dict[str, Any],
    queue: str,
    eta: datetime | None = None,
    retry: bool = True,
) -> None:
    """Send one Celery message; no result is ever wanted. Without `ignore_result` and a bare
    result class, every send builds an AsyncResult, whose result backend Celery builds once per
    thread by scanning every installed package's entry points: 3 % of the API's CPU under load,
    as the thread pool turns over (py-spy)."""
    get_celery().send_task(
        task,
        kwargs=kwargs,
        queue=queue,
        eta=eta,
        retry=retry,
        retry_policy=RETRY_POLICY,
        ignore_result=True,
        add_to_parent=False,
        result_cls=_NoResult,
    )


@after_commit
def flush_committed(session: Session) -> None:
    """Send what the session committed, then mark it sent in one statement. Called by the
    unit-of-work wrappers after commit. A crash between the two leaves the rows unsent and the
    beat drainer sends them again: tasks take ids and are idempotent, so a repeat is harmless,
    while a message never sent would not be."""
    msgs = session.info.pop("rackplane_outbox_committed", None)
    if not msgs:
        return
    if time.monotonic() < _breaker["open_until"]:
        return  # the broker failed a moment ago: the drainer sends these once it is back
    sent = []
    try:
        for mid, task, kwargs, queue, eta in msgs:
            publish(task, kwargs=kwargs, queue=queue, eta=eta)
            sent.append(mid)
    except Exception as exc:  # the drainer will send the rest; the change itself is committed
        _breaker["open_until"] = time.monotonic() + BREAKER_SECONDS
        log.warning("outbox_send_deferred", ids=[m[0] for m in msgs], error=str(exc))
    if sent:
        _marker.mark(sent)


class _Marker:
    """Marks sent outbox rows from a background thread, many per statement, so a request does
    not wait for a second transaction. Lost marks (the process dies first) only mean the
    drainer sends those messages again, which idempotent tasks absorb."""

    def __init__(self) -> None:
        import queue
        import threading

        self.q: queue.Queue[int] = queue.Queue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def mark(self, ids: list[int]) -> None:
        import threading

        for i in ids:
            self.q.put(i)
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, daemon=True, name="outbox-mark")
                self.thread.start()

    def _run(self) -> None:
        import queue

        while True:
            try:
                ids = [self.q.get(timeout=5)]
            except queue.Empty:
                return
            while len(ids) < 500:
                try:
                    ids.append(self.q.get_nowait())
                except queue.Empty:
                    break
            try:
                with get_sessionmaker()() as s:
                    s.execute(
                        update(OutboxMessage)
                        .where(OutboxMessage.id.in_(ids), OutboxMessage.sent_at.is_(None))
                        .values(sent_at=utcnow(), attempts=OutboxMessage.attempts + 1)
                    )
                    s.commit()
            except Exception as exc:  # the drainer covers it
                log.warning("outbox_mark_failed", ids=len(ids), error=str(exc))


_marker = _Marker()


def send(
    ids: list[int] | None = None, *, older_than: timedelta | None = None, limit: int = 500
) -> int:
    """Send unsent messages (the given ids, or all older than `older_than`). Returns how many."""
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
                publish(
                    msg.task,
                    kwargs=msg.kwargs,
                    queue=msg.queue,
                    eta=as_aware(msg.eta) if msg.eta is not None else None,
                )
            except Exception as exc:
                msg.last_error = str(exc)[:1000]
                session.commit()
                raise
            msg.sent_at = utcnow()
            sent += 1
        session.commit()
    return sent
