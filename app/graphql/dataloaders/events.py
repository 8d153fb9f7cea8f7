"""A page of workloads' newest events, through the caller's tenant scope."""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select, true
from sqlalchemy.orm import Session

from app.models.workloads import Workload, WorkloadEvent
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import restrict

EVENTS_PER_WORKLOAD = 20  # the newest events a workload shows in one query
# What a workload's events show (app/graphql/types.WorkloadEvent), and whose they are.
_EVENT_COLUMNS = (
    WorkloadEvent.workload_id,
    WorkloadEvent.seq,
    WorkloadEvent.kind,
    WorkloadEvent.from_state,
    WorkloadEvent.to_state,
    WorkloadEvent.reason,
    WorkloadEvent.details,
    WorkloadEvent.at,
)
# A workload's newest events, correlated to the workload of the enclosing query.
_NEWEST = (
    select(*_EVENT_COLUMNS)
    .where(WorkloadEvent.workload_id == Workload.id)
    .order_by(WorkloadEvent.seq.desc())
    .limit(EVENTS_PER_WORKLOAD)
    .lateral("newest")
)


def newest(session: Session, auth: AuthContext, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[Any]]:
    """The newest events of each workload (oldest first), in one statement, through the
    tenant scope: rows, not ORM objects (a page of 50 workloads is 1,000 events at most;
    as objects they, and the aliased entity the query needed, were cyclic garbage that
    only full collections freed)."""
    by: dict[uuid.UUID, list[Any]] = defaultdict(list)
    if not ids:
        return by
    if session.get_bind().dialect.name == "postgresql":
        # Per workload, its newest events by the (workload, seq) index: a LATERAL join
        # reads 20 rows a workload, however long its history. The owned workloads are
        # the scoped part; the lateral subquery is built once.
        stmt = restrict(
            auth,
            select(*_NEWEST.c)
            .select_from(Workload)
            .join(_NEWEST, true())
            .where(Workload.id.in_(ids))
            .order_by(_NEWEST.c.workload_id, _NEWEST.c.seq),
            Workload,
        )
    else:
        rank = (
            func.row_number()
            .over(partition_by=WorkloadEvent.workload_id, order_by=WorkloadEvent.seq.desc())
            .label("rank")
        )
        ranked = restrict(
            auth,
            select(*_EVENT_COLUMNS, rank).where(WorkloadEvent.workload_id.in_(ids)),
            WorkloadEvent,
        ).subquery()
        stmt = (
            select(*[ranked.c[c.key] for c in _EVENT_COLUMNS])
            .where(ranked.c.rank <= EVENTS_PER_WORKLOAD)
            .order_by(ranked.c.workload_id, ranked.c.seq)
        )
    for e in session.execute(stmt):
        by[e.workload_id].append(e)
    return by


def load(session: Session, auth: AuthContext, ids: list[uuid.UUID]) -> list[list[Any]]:
    by = newest(session, auth, ids)
    return [by.get(i, []) for i in ids]
