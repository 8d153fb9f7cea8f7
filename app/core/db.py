"""Engine, sessions and the declarative base.

Only the request dependency (`session_dependency`) and task wrappers (`session_scope`)
commit; services and repositories flush at most.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, MetaData, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InternalError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from app.core.config import get_settings

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_aware(dt: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored as UTC); PostgreSQL aware ones."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def new_id() -> uuid.UUID:
    return uuid.uuid4()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: DateTime(timezone=True)}


class TimestampMixin:
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


def _sqlite_pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - trivial
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # POOL_SIZE + MAX_OVERFLOW stays above the API's in-flight limit (settings.api_max_in_flight)
    # plus the outbox marker's connection. POOL_SIZE is the connections kept open: at 10, a
    # thousand agents' requests opened and closed ~2,000 overflow connections a minute.
    engine = create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW)
    event.listen(engine, "handle_error", _failover_is_disconnect)
    return engine


# What a PostgreSQL failover looks like on a connection that is still open (docs/ha.md): the
# server it reaches is a replica now (a demoted leader), or is going down. Pre-ping cannot see
# either (SELECT 1 works on a replica), so the error counts as a disconnect: SQLAlchemy drops
# the whole pool, and the next connections find the new leader through the URL's
# target_session_attrs=read-write.
FAILOVER_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def _failover_is_disconnect(ctx: Any) -> None:
    if getattr(ctx.original_exception, "sqlstate", None) in FAILOVER_SQLSTATES:
        ctx.is_disconnect = True


# What a Celery task retries on, with backoff: a lost or refused connection (OperationalError)
# and a write reaching a node that just became a replica (25006, which SQLAlchemy wraps as
# InternalError). Tasks are idempotent (outbox delivery, state and generation checks).
RETRY_DB = (OperationalError, InternalError)


POOL_SIZE, MAX_OVERFLOW = 20, 20


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().sqlalchemy_url)


@lru_cache
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """A unit of work for tasks and the CLI: commit on success, roll back on error."""
    session = get_sessionmaker()()
    try:
        yield session
    except BaseException:
        _discard(session)
        raise
    _finish(session)


# What runs after a unit of work commits, in order: each is handed the closed session and sends
# what the commit released. The outbox registers its senders when it is imported, which any code
# that writes an outbox message or a kick does first; `core` itself imports nothing above it.
_AFTER_COMMIT: list[Callable[[Session], None]] = []


def after_commit(hook: Callable[[Session], None]) -> Callable[[Session], None]:
    """Register `hook` to run after every unit of work's commit (once, however often asked)."""
    if hook not in _AFTER_COMMIT:
        _AFTER_COMMIT.append(hook)
    return hook


def _finish(session: Session) -> None:
    """Commit and close, then run the after-commit hooks (outbox messages, kicks)."""
    try:
        session.commit()
    except BaseException:
        _discard(session)
        raise
    session.close()
    for hook in _AFTER_COMMIT:
        hook(session)


def _discard(session: Session) -> None:
    try:
        session.rollback()
    finally:
        session.close()


_FINISHED = "rackplane_request_finished"


def finish_request_session(session: Session) -> None:
    """Commit a request's session where its endpoint ran (app/core/routing.py)."""
    _finish(session)
    session.info[_FINISHED] = True


async def session_dependency() -> AsyncIterator[Session]:
    """FastAPI dependency: one session per request. Sync endpoints on `api_router`s commit it
    themselves before answering (app/core/routing.py); for any other user it is committed
    here, in one thread-pool hop. Opening it costs no hop (no I/O until first use)."""
    import anyio
    from starlette.concurrency import run_in_threadpool

    session = get_sessionmaker()()
    try:
        yield session
    except BaseException:
        with anyio.CancelScope(shield=True):  # a cancelled request still returns its connection
            await run_in_threadpool(_discard, session)
        raise
    if not session.info.pop(_FINISHED, False):
        await run_in_threadpool(_finish, session)


def dialect_insert(session: Session, table: Any) -> Any:
    """INSERT for `table` in the session's dialect, which has `on_conflict_do_*` (PostgreSQL
    in production, SQLite on the embedded default)."""
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    pg = session.get_bind().dialect.name == "postgresql"
    return (pg_insert if pg else sqlite_insert)(table)


def insert_objects(session: Session, objs: list) -> None:
    """INSERT transient ORM objects of one class in one Core executemany (psycopg pipelines
    it), bypassing the unit of work: for hot batches the session need not track. The objects
    stay transient; columns they leave unset get their defaults in the statement."""
    from sqlalchemy import insert, inspect

    if not objs:
        return
    mapper = inspect(type(objs[0]))
    keys = {a.key for a in mapper.column_attrs}
    session.execute(
        insert(mapper.local_table),
        [{k: v for k, v in inspect(o).dict.items() if k in keys} for o in objs],
    )


def get_or_404(session: Session, model, obj_id, *, what: str, for_update: bool = False):
    """Fetch a platform-owned row (fleet objects) by id, or raise 404. Tenant-owned rows use
    `app.tenancy.scoping.get_owned` instead."""
    from app.core.errors import NotFound

    try:
        oid = obj_id if isinstance(obj_id, uuid.UUID) else uuid.UUID(str(obj_id))
    except ValueError:
        raise NotFound(f"No {what} with id {obj_id!s}.", code=f"{what}_not_found") from None
    obj = session.get(model, oid, with_for_update=for_update or None)
    if obj is None:
        raise NotFound(f"No {what} with id {oid}.", code=f"{what}_not_found")
    return obj
