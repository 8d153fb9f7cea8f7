"""Kicks: after a commit that leaves work for a periodic sweep, ask for the sweep to run now,
coalesced so that a burst of commits sends one message instead of one each.

A kick is not durable and need not be: the committed rows are the record of the work, and a
beat task runs the same sweep on a timer (the placement tick). A kick only makes it come sooner.
That is what separates a kick from an outbox message, which carries work nothing else would
find, and why a kick costs a request no database write.

Coalescing, with Redis: after its commit a writer `SET`s the kick's key `NX` with a short TTL
and sends the task only if the key was absent; the task deletes the key (`clear`) before it
reads the database. So a writer that finds the key present knows that a sweep is still to read
the database after its commit and will see its rows. A message lost after its key was set only
mutes the key until the TTL ends; the timer covers that gap. Without Redis (the embedded
default) every kick is sent: the rate there is a person's, not a load test's.

Hand-over, for sweeps that exclude each other (one placement cycle per region at a time): a run
that finds the sweep busy must not simply give up, since the busy one may have read the database
before the rows that kicked this run. Instead of polling until the lock frees, it leaves a
`hand_over` flag and tries the lock once more: if that fails, the lock's holder has not yet
committed, and it takes the flag (`take_hand_over`) only after its commit, so it sees the flag
and runs again. Either this run gets the lock or the holder runs again: no work waits for the
timer, and no message goes round the broker.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from app.core import redis
from app.core.config import get_settings
from app.core.db import after_commit
from app.core.logging import get_logger

log = get_logger(__name__)
TTL_MS = 2000
HAND_OVER_TTL_MS = 60_000  # longer than any holder's transaction
_PENDING = "rackplane_kicks_pending"
_COMMITTED = "rackplane_kicks_committed"


def kick(session: Session, task: str, *, queue: str, key: str, **kwargs: Any) -> None:
    """Ask for `task(**kwargs)` once the session's transaction commits, coalesced under `key`
    with every other kick of the same task and key."""
    session.info.setdefault(_PENDING, {})[(task, key)] = (queue, kwargs)


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    pending = session.info.pop(_PENDING, None)
    if pending:
        session.info.setdefault(_COMMITTED, {}).update(pending)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)


def _name(task: str, key: str) -> str:
    return f"{get_settings().broker_key_prefix}rackplane:kick:{task}:{key}"


@after_commit
def send_committed(session: Session) -> None:
    """Send the kicks the session committed (called by the unit-of-work wrappers after commit).
    Failures are logged and dropped: the timer runs the sweep anyway."""
    committed = session.info.pop(_COMMITTED, None)
    if not committed:
        return
    client = redis.client()
    if client is None and get_settings().redis_url:
        return  # the breaker is open: the timer runs the sweep
    try:
        for (task, key), (queue, kwargs) in committed.items():
            if client is not None and not client.set(_name(task, key), b"1", nx=True, px=TTL_MS):
                continue  # a sweep that has not read the database yet is already asked for
            from app.outbox.service import publish

            publish(task, kwargs=kwargs, queue=queue, retry=False)
    except Exception as exc:
        redis.trip()
        log.warning("kick_dropped", kicks=[k for k, _ in committed], error=str(exc)[:300])


def clear(task: str, key: str) -> None:
    """Called by the kicked task before it reads the database: writers committing from now on
    must kick again, because this run may not see their rows."""
    try:
        client = redis.client()
        if client is not None:
            client.delete(_name(task, key))
    except Exception as exc:  # the key expires by itself; the timer covers the gap
        log.warning("kick_clear_failed", task=task, key=key, error=str(exc)[:300])


def _hand_over_name(task: str, key: str) -> str:
    return f"{get_settings().broker_key_prefix}rackplane:hand-over:{task}:{key}"


def hand_over(task: str, key: str) -> bool:
    """Ask the running holder of `task`/`key` to run again after its commit. False when Redis
    cannot carry the request (the caller then retries by itself)."""
    client = redis.client()
    if client is None:
        return False
    try:
        client.set(_hand_over_name(task, key), b"1", px=HAND_OVER_TTL_MS)
        return True
    except Exception as exc:
        redis.trip()
        log.warning("hand_over_failed", task=task, key=key, error=str(exc)[:300])
        return False


def take_hand_over(task: str, key: str) -> bool:
    """Called by the holder after its commit: whether a run was handed over to it meanwhile."""
    client = redis.client()
    if client is None:
        return False
    try:
        return client.getdel(_hand_over_name(task, key)) is not None
    except Exception as exc:  # the flag expires; the timer covers the gap
        redis.trip()
        log.warning("take_hand_over_failed", task=task, key=key, error=str(exc)[:300])
        return False
