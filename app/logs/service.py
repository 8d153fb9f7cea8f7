"""Workload logs: chunks of each replica's output as node agents ship them, and reads of them.

- **Ingest** (`ingest`): a chunk names its run (workload, attempt, replica) and its byte offset
  in that run's output. It is taken only from the node holding that run: the allocation of that
  replica made for that very attempt is on the node (released or not: the tail an agent ships
  after the exit still counts), never another attempt's, never another node's; anything else is
  counted as stale and dropped. A chunk sent again (same run and
  offset) is stored once (`INSERT ... ON CONFLICT DO NOTHING`), so an agent may resend a batch
  whose answer it lost. Each workload keeps at most `log_max_bytes_per_workload` bytes (its
  oldest chunks go first), counted in `workload_log_sizes` by the same transactions that store
  and delete chunks (a batch costs what it adds and removes, not a read of the workload's log),
  and its readers are woken (`topic`) when the batch commits. Locks, in every writer: new
  chunks, then the workloads' size rows (by id), then their old chunks.
- **Reads** (`read`, `follow_step`, `tail_start`): a tenant's own workloads only (another
  tenant's is a 404, as everywhere), in arrival order (`id`), after a cursor, bounded in items
  and bytes. Followers read only up to the log's settled horizon (app/core/logtail.py), so
  resuming from the last id seen misses nothing and repeats nothing.
- **Retention** (`prune`): chunks older than `log_retention_hours` (by arrival) go, hourly.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.core import pubsub
from app.core.config import get_settings
from app.core.db import as_aware, dialect_insert, utcnow
from app.logs.schemas import LogChunkOut, LogPage
from app.models.logs import WorkloadLog, WorkloadLogSize
from app.models.workloads import Allocation, State, Workload
from app.tenancy.nodes import NodeCaller
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import get_owned, restrict, scoped_select
from rackplane_wire import LogAck, LogBatch

TABLE = WorkloadLog.__tablename__
# A workload whose run can no longer write output: a follower stops once it has read it all.
ENDED = frozenset({State.succeeded.value, State.failed.value, State.terminated.value})
DEFAULT_LIMIT = 200
MAX_LIMIT = 1000
# A page carries at most this much text (at least one chunk, whatever its size).
PAGE_BYTES = 1 << 20
# Where a follower that names no cursor starts: the newest chunks, up to this much.
TAIL_BYTES = 128 << 10
TAIL_CHUNKS = 2000
_KEY = ["workload_id", "attempt", "replica", "offset"]


def topic(workload_id: uuid.UUID | str) -> str:
    """The wake-up of a workload's log readers (app/core/pubsub.py)."""
    return f"workload-logs:{workload_id}"


@dataclass(frozen=True)
class LogQuery:
    """Which of a workload's chunks a reader wants: one replica's or all, one attempt's or
    all, and those the agent read at or after `since`."""

    replica: int | None = None
    attempt: int | None = None
    since: datetime | None = None


# --- ingest -------------------------------------------------------------------------------------


def _text(data: str) -> str:
    # PostgreSQL's text holds no NUL; a process may well print one.
    return data.replace("\x00", "\ufffd") if "\x00" in data else data


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def _run(attempt: int, replica: int) -> str:
    return f"{attempt}/{replica}"


def ingest(session: Session, caller: NodeCaller, batch: LogBatch) -> LogAck:
    """Store a node agent's batch of output chunks (see the module): how many were taken
    (stored now or before) and how many were about runs the node does not hold."""
    ids = {wid for c in batch.chunks if (wid := _uuid(c.workload_id)) is not None}
    # (workload, attempt, replica) -> tenant: the runs this node holds or held.
    held: dict[tuple[uuid.UUID, int, int], uuid.UUID] = {}
    dropped: dict[uuid.UUID, dict[str, int]] = {}
    if ids:
        rows = session.execute(
            select(
                Allocation.workload_id, Allocation.attempt, Allocation.replica, Allocation.tenant_id
            ).where(Allocation.node_id == caller.node_id, Allocation.workload_id.in_(ids))
        )
        held = {(r.workload_id, r.attempt, r.replica): r.tenant_id for r in rows}
        sizes = select(WorkloadLogSize.workload_id, WorkloadLogSize.dropped_below).where(
            WorkloadLogSize.workload_id.in_({w for w, _, _ in held})
        )
        dropped = {w: below or {} for w, below in session.execute(sizes)} if held else {}
    now = utcnow()
    fresh: dict[tuple[Any, ...], dict[str, Any]] = {}
    stale = 0
    for c in batch.chunks:
        wid = _uuid(c.workload_id)
        tenant = held.get((wid, c.attempt, c.replica)) if wid is not None else None
        if wid is None or tenant is None:
            stale += 1
            continue
        if c.offset < dropped.get(wid, {}).get(_run(c.attempt, c.replica), 0):
            continue  # stored once already, and deleted since (the cap, the retention)
        fresh.setdefault(
            (wid, c.attempt, c.replica, c.offset),
            {
                "workload_id": wid,
                "tenant_id": tenant,
                "attempt": c.attempt,
                "replica": c.replica,
                "offset": c.offset,
                "data": _text(c.data),
                "bytes": len(c.data.encode()),
                "at": as_aware(c.at),
                "received_at": now,
            },
        )
    if fresh:
        _store(session, [fresh[k] for k in sorted(fresh, key=lambda k: (str(k[0]), *k[1:]))])
    return LogAck(accepted=len(batch.chunks) - stale, stale=stale)


def _store(session: Session, rows: list[dict[str, Any]]) -> None:
    """Insert new chunks (in key order: two transactions storing overlapping chunks wait for
    each other in one order, never in a cycle), count them into their workloads' sizes, keep
    each workload under the cap, and wake its readers once this commits."""
    stored = session.execute(
        dialect_insert(session, WorkloadLog.__table__)
        .on_conflict_do_nothing(index_elements=_KEY)
        .returning(WorkloadLog.workload_id, WorkloadLog.bytes),
        rows,
    )
    added: dict[uuid.UUID, int] = defaultdict(int)
    for wid, size in stored:
        added[wid] += size
    if not added:
        return
    cap = get_settings().log_max_bytes_per_workload
    for wid, total in _grow(session, added):
        if total > cap:
            _shrink(session, wid, total - cap)
    pubsub.mark(session, *(topic(w) for w in added))


def _grow(session: Session, added: dict[uuid.UUID, int]) -> list[tuple[uuid.UUID, int]]:
    """Add the bytes just stored to each workload's size (locking its row, in id order, for
    the rest of the transaction); the new sizes."""
    table = WorkloadLogSize.__table__
    stmt = dialect_insert(session, table)
    stmt = stmt.on_conflict_do_update(
        index_elements=["workload_id"], set_={"bytes": table.c.bytes + stmt.excluded.bytes}
    ).returning(table.c.workload_id, table.c.bytes)
    rows = [{"workload_id": w, "bytes": added[w]} for w in sorted(added, key=str)]
    grown = [(r.workload_id, r.bytes) for r in session.execute(stmt, rows)]
    return sorted(grown, key=lambda r: str(r[0]))


_GONE = (WorkloadLog.attempt, WorkloadLog.replica, WorkloadLog.offset, WorkloadLog.bytes)


def _shrink(session: Session, workload_id: uuid.UUID, excess: int) -> int:
    """Delete the workload's oldest chunks until `excess` bytes are gone (whole chunks, so a
    little more); its size row must be locked. How many chunks went."""
    gone: list[Any] = []
    removed = 0
    while removed < excess:
        oldest = session.execute(
            select(WorkloadLog.id, WorkloadLog.bytes)
            .where(WorkloadLog.workload_id == workload_id)
            .order_by(WorkloadLog.id)
            .limit(500)
        ).all()
        if not oldest:  # nothing left: the size was off, and is exact again
            _forget(session, workload_id, gone, exact=0)
            return len(gone)
        cut, want = oldest[-1].id, removed
        for row in oldest:
            want += row.bytes
            if want >= excess:
                cut = row.id
                break
        batch = session.execute(
            delete(WorkloadLog)
            .where(WorkloadLog.workload_id == workload_id, WorkloadLog.id <= cut)
            .returning(*_GONE)
        ).all()
        gone += batch
        removed += sum(r.bytes for r in batch)
    _forget(session, workload_id, gone)
    return len(gone)


def _forget(
    session: Session, workload_id: uuid.UUID, gone: list[Any], exact: int | None = None
) -> None:
    """Take deleted chunks (rows of `_GONE`) out of their workload's size, and remember where
    each run's deleted output ends. The size row is locked by the caller."""
    if not gone and exact is None:
        return
    row = session.execute(
        select(WorkloadLogSize.bytes, WorkloadLogSize.dropped_below).where(
            WorkloadLogSize.workload_id == workload_id
        )
    ).first()
    if row is None:
        return
    below = dict(row.dropped_below or {})
    for r in gone:
        run = _run(r.attempt, r.replica)
        below[run] = max(below.get(run, 0), r.offset + r.bytes)
    size = exact if exact is not None else row.bytes - sum(r.bytes for r in gone)
    session.execute(
        update(WorkloadLogSize)
        .where(WorkloadLogSize.workload_id == workload_id)
        .values(bytes=size, dropped_below=below)
    )


# --- reads --------------------------------------------------------------------------------------


def _filtered(auth: AuthContext, workload_id: uuid.UUID, query: LogQuery, *columns: Any):
    """The workload's chunks that `query` wants (whole rows, or `columns` of them), in the
    caller's tenant scope."""
    stmt = (
        restrict(auth, select(*columns), WorkloadLog)
        if columns
        else scoped_select(auth, WorkloadLog)
    )
    stmt = stmt.where(WorkloadLog.workload_id == workload_id)
    if query.replica is not None:
        stmt = stmt.where(WorkloadLog.replica == query.replica)
    if query.attempt is not None:
        stmt = stmt.where(WorkloadLog.attempt == query.attempt)
    if query.since is not None:
        stmt = stmt.where(WorkloadLog.at >= as_aware(query.since))
    return stmt


def _page(
    session: Session,
    auth: AuthContext,
    workload_id: uuid.UUID,
    query: LogQuery,
    after: int | None,
    upto: int | None,
    limit: int,
) -> tuple[LogPage, bool]:
    """A page after `after` (up to `upto`), and whether more chunks wait past it."""
    sizes = _filtered(auth, workload_id, query, WorkloadLog.id, WorkloadLog.bytes)
    if after is not None:
        sizes = sizes.where(WorkloadLog.id > after)
    if upto is not None:
        sizes = sizes.where(WorkloadLog.id <= upto)
    last, total, seen, more = None, 0, 0, False
    for chunk_id, size in session.execute(sizes.order_by(WorkloadLog.id).limit(limit)):
        if last is not None and total + size > PAGE_BYTES:
            more = True
            break
        last, total, seen = chunk_id, total + size, seen + 1
    if last is None:
        return LogPage(items=[], next_after=after), False
    rows = _filtered(auth, workload_id, query).where(WorkloadLog.id <= last)
    if after is not None:
        rows = rows.where(WorkloadLog.id > after)
    items = [LogChunkOut.model_validate(r) for r in session.scalars(rows.order_by(WorkloadLog.id))]
    page = LogPage(items=items, next_after=items[-1].id if items else after)
    return page, more or seen == limit


@dataclass(frozen=True)
class FollowStep:
    """One read of a follower: the page, whether more waits past it, and the workload (its id
    and its state as read just before the page)."""

    page: LogPage
    more: bool
    workload_id: uuid.UUID
    state: str


def owned_workload(session: Session, auth: AuthContext, workload_id: uuid.UUID | str) -> uuid.UUID:
    """The id of a workload `auth` may read (404 otherwise)."""
    return get_owned(session, auth, Workload, workload_id, what="workload").id


def read(
    session: Session,
    auth: AuthContext,
    workload_id: uuid.UUID | str,
    query: LogQuery = LogQuery(),
    *,
    after: int | None = None,
    upto: int | None = None,
    limit: int = DEFAULT_LIMIT,
) -> LogPage:
    """A page of the workload's output after the chunk `after` (None: from the oldest kept),
    at most `limit` chunks and about `PAGE_BYTES` of text, none past the id `upto` (a
    follower's horizon)."""
    w = get_owned(session, auth, Workload, workload_id, what="workload")
    return _page(session, auth, w.id, query, after, upto, min(limit, MAX_LIMIT))[0]


def follow_step(
    session: Session,
    auth: AuthContext,
    workload_id: uuid.UUID | str,
    query: LogQuery,
    *,
    after: int | None,
    upto: int,
    limit: int = DEFAULT_LIMIT,
) -> FollowStep:
    """A follower's read: the next page up to the horizon `upto`, with the workload's state as
    it was just before (so an ended workload's last output is in this page or an earlier one,
    but for what its agents send after the end)."""
    w = get_owned(session, auth, Workload, workload_id, what="workload")
    state = w.state
    page, more = _page(session, auth, w.id, query, after, upto, min(limit, MAX_LIMIT))
    return FollowStep(page=page, more=more, workload_id=w.id, state=state)


def tail_start(
    session: Session,
    auth: AuthContext,
    workload_id: uuid.UUID | str,
    query: LogQuery = LogQuery(),
    *,
    max_bytes: int = TAIL_BYTES,
    max_chunks: int = TAIL_CHUNKS,
) -> int:
    """The cursor a follower starts from to see the newest output first: just before the
    newest chunks that fit `max_bytes` (at least one) and `max_chunks`."""
    w = get_owned(session, auth, Workload, workload_id, what="workload")
    sizes = _filtered(auth, w.id, query, WorkloadLog.id, WorkloadLog.bytes)
    total, oldest = 0, None
    newest_first = sizes.order_by(WorkloadLog.id.desc()).limit(max_chunks)
    for chunk_id, size in session.execute(newest_first):
        if oldest is not None and total + size > max_bytes:
            return chunk_id  # the newest chunk left out: read after it
        total, oldest = total + size, chunk_id
    return 0 if oldest is None else oldest - 1


def ended(state: str) -> bool:
    return state in ENDED


# --- retention ----------------------------------------------------------------------------------


def prune(session: Session, now: datetime | None = None) -> int:
    """Delete chunks that arrived more than `log_retention_hours` ago; how many went. Each
    workload's size row is locked before its chunks are deleted, as ingest does."""
    cutoff = (now or utcnow()) - timedelta(hours=get_settings().log_retention_hours)
    old = WorkloadLog.received_at < cutoff
    workloads = session.scalars(select(WorkloadLog.workload_id).where(old).distinct()).all()
    count = 0
    for wid in sorted(workloads, key=str):
        session.execute(
            select(WorkloadLogSize.workload_id)
            .where(WorkloadLogSize.workload_id == wid)
            .with_for_update()
        )
        gone = session.execute(
            delete(WorkloadLog).where(WorkloadLog.workload_id == wid, old).returning(*_GONE)
        ).all()
        _forget(session, wid, gone)
        count += len(gone)
    return count
