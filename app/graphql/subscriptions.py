"""Subscriptions over `graphql-transport-ws` (at /graphql): a tenant's workload events as they
happen, and, for operators, every tenant's events and the fleet's health changes.

The source is the transaction log REST reads (`workload_events`, `health_events`), never a
message: a subscription reads rows from the database, in id order and through the tenant scope,
and Redis pub/sub (in process without Redis: app/core/pubsub.py) only wakes it when a commit
wrote rows for its tenant, with a poll every `POLL_S` in case a message is lost. Each read is
a short session on a worker thread; nothing is held open while waiting.

Cursors: an item's `cursor` is its row's global id, and `after: <cursor>` delivers the rows
after it. Rows are delivered only up to the log's settled horizon (app/core/logtail.py), below
which no row can still appear though transactions commit out of id order, so resuming with
the last cursor seen misses nothing and repeats nothing (the horizon's documented edge aside: a
transaction holding an id open past `LogTail.MAX_WAIT_S`). Without `after`, a subscription
starts at the horizon: what commits from then on (and possibly the last few rows committed
just before, when the horizon was held back by a gap).

Authentication: the same API keys as REST, from the websocket handshake's `Authorization`
header or else the `connection_init` payload's `{"Authorization": "Bearer rp_..."}`. A refused
key, a missing one or a wrong scope ends the subscription with an error carrying REST's code in
`extensions.code`. A key revoked while subscribed ends it within `RECHECK_S`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from datetime import datetime
from typing import Any

import strawberry
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from strawberry.scalars import JSON
from strawberry.types.unset import UNSET

from app.core import logtail, pubsub
from app.core.db import as_aware, get_sessionmaker
from app.core.errors import AppError, ValidationFailed
from app.graphql.context import Context, coded, sign_in
from app.graphql.views import text_args
from app.graphql.workloads import WorkloadEvent
from app.health.transitions import FLEET_TOPIC
from app.models.fleet import Node
from app.models.health import HealthEvent
from app.models.workloads import Workload
from app.models.workloads import WorkloadEvent as Row
from app.scheduling.lifecycle import events_topic
from app.tenancy.auth import Credential
from app.tenancy.principal import AuthContext, require_platform, require_tenant_scope
from app.tenancy.scoping import get_owned, scoped_select

POLL_S = 3.0  # a read even without a wake-up (a lost message costs at most this)
PAGE = 200  # rows per read
RECHECK_S = 30.0  # how often a subscription checks that its key is still live


# --- authentication of a websocket --------------------------------------------------------------


def _payload_key(params: Any) -> str | None:
    if not isinstance(params, dict):
        return None
    for name, value in params.items():
        if isinstance(name, str) and name.lower() == "authorization" and isinstance(value, str):
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
    return None


async def on_ws_connect(context: Any) -> Any:
    """The schema's router calls this on `connection_init`: the key from its payload
    (`{"Authorization": "Bearer rp_..."}`: browsers cannot set a websocket's headers) when the
    handshake sent none; the handshake's header, when sent, wins."""
    if isinstance(context, Context) and context._auth is None and not context._auth_error:
        raw = _payload_key(context.connection_params)
        if raw:
            await sign_in(
                context, Credential("key", raw), context.request.scope if context.request else {}
            )
    return UNSET


# --- what is delivered ----------------------------------------------------------------------------


@strawberry.type(description="A workload event as it happens, with its place in the log")
class WorkloadEventUpdate(WorkloadEvent):
    cursor: str = strawberry.field(description="Pass as `after` to resume after this event")
    workload_id: strawberry.ID
    tenant_id: strawberry.ID


@strawberry.type(description="A health transition of a node or one of its GPUs, as it happens")
class FleetChange:
    cursor: str = strawberry.field(description="Pass as `after` to resume after this change")
    node_id: strawberry.ID
    node: str
    gpu_index: int | None = strawberry.field(description="Set when a GPU moved, null for a node")
    region: str
    rack: str
    from_state: str
    to_state: str
    actor: str
    cause: str
    details: JSON
    at: datetime


def _event(e: Any) -> WorkloadEventUpdate:
    return WorkloadEventUpdate.of(
        e,
        cursor=str(e.id),
        workload_id=strawberry.ID(str(e.workload_id)),
        tenant_id=strawberry.ID(str(e.tenant_id)),
    )


def _change(h: Any, node: str) -> FleetChange:
    return FleetChange(
        cursor=str(h.id),
        node_id=strawberry.ID(str(h.node_id)),
        node=node,
        gpu_index=h.gpu_index,
        region=h.region,
        rack=h.rack,
        from_state=h.from_state,
        to_state=h.to_state,
        actor=h.actor,
        cause=h.cause,
        details=h.details or {},
        at=as_aware(h.at),
    )


# --- following a log ----------------------------------------------------------------------------


def _start(after: str | None) -> int | None:
    if after is None:
        return None
    if not (after.isascii() and after.isdigit()) or int(after) >= 2**63:
        raise ValidationFailed(
            "after is a cursor from an earlier item (digits).", code="invalid_cursor"
        )
    return int(after)


async def _follow(
    context: Context,
    allowed: Callable[[AuthContext], None],
    table: str,
    matches: Callable[[str], bool],
    read: Callable[[int, int, int], list[Any]],
    cursor: int | None,
) -> AsyncGenerator[Any, None]:
    """Rows of `table` after `cursor` (None: from the horizon), read by `read(after, upto,
    limit)` in id order, then as they commit, for as long as the caller's key is `allowed`."""
    tail = logtail.tail(table)
    waiter = pubsub.hub.register(matches)  # before the first read: no wake-up falls between
    checked = time.monotonic()
    try:
        if cursor is None:
            cursor, held = await tail.horizon(time.monotonic())
            if held:  # a fresh tail waits out old gaps once, rather than replay past them
                await asyncio.sleep(tail.GRACE_S * 1.5)
                cursor, _ = await tail.horizon(time.monotonic())
        since = time.monotonic()
        while True:
            waiter.clear()
            horizon, held = await tail.horizon(max(since, waiter.woken_at))
            while cursor < horizon:
                rows = await run_in_threadpool(read, cursor, horizon, PAGE)
                for row in rows:
                    cursor = int(row.cursor)
                    yield row
                if len(rows) < PAGE:
                    cursor = horizon  # everything up to the horizon is read (and settled)
            if time.monotonic() - checked > RECHECK_S:
                checked = time.monotonic()
                await still_allowed(context, allowed)
            woken = await waiter.wait(tail.GRACE_S if held else POLL_S)
            # Woken: a read started after the wake-up sees what woke it (and is shared with
            # the waiters woken with it). Not: a poll, of what committed until now.
            since = 0.0 if woken else time.monotonic()
    finally:
        pubsub.hub.unregister(waiter)


async def still_allowed(context: Context, allowed: Callable[[AuthContext], None]) -> None:
    """The key again, as it is now (revoked, expired, its tenant suspended: the end)."""
    cred = getattr(context, "_ws_cred", None)
    if cred is None:
        return
    try:
        allowed(await cred.resolve())
    except AppError as e:
        raise coded(e) from e


def log_reader(auth: AuthContext) -> None:
    if not auth.is_platform:
        require_tenant_scope(auth, "read")


def _owned_workload(auth: Any, workload_id: str) -> uuid.UUID:
    with get_sessionmaker()() as s:
        return get_owned(s, auth, Workload, workload_id, what="workload").id


@strawberry.type
class Subscription:
    @strawberry.subscription(
        description="The caller's workload events (operators: every tenant's) in log order: "
        "replayed after the cursor `after`, then as they happen"
    )
    def workload_events(
        self,
        info: strawberry.Info[Context, None],
        after: str | None = None,
        workload_id: strawberry.ID | None = None,
    ) -> AsyncGenerator[WorkloadEventUpdate, None]:
        try:  # refusals as REST's, raised here: a subscription's errors are its own
            auth = info.context.auth
            log_reader(auth)
            cursor = _start(after)
            # One lookup by primary key, here rather than in the stream: a refusal is the
            # protocol's `error` (the subscription never starts), not an item of it.
            wid = _owned_workload(auth, str(workload_id)) if workload_id is not None else None
        except AppError as e:
            raise coded(e) from e
        if auth.is_platform:
            matches: Callable[[str], bool] = lambda t: t.startswith(events_topic(""))  # noqa: E731
        else:
            mine = events_topic(auth.tenant_id)
            matches = mine.__eq__

        def read(lo: int, hi: int, limit: int) -> list[WorkloadEventUpdate]:
            stmt = scoped_select(auth, Row).where(Row.id > lo, Row.id <= hi)
            if wid is not None:
                stmt = stmt.where(Row.workload_id == wid)
            with get_sessionmaker()() as s:
                return [_event(e) for e in s.scalars(stmt.order_by(Row.id).limit(limit))]

        return _follow(info.context, log_reader, "workload_events", matches, read, cursor)

    @strawberry.subscription(
        description="Operators: health transitions of nodes and GPUs in log order: replayed "
        "after the cursor `after`, then as they happen"
    )
    def fleet_changes(
        self,
        info: strawberry.Info[Context, None],
        after: str | None = None,
        region: str | None = None,
    ) -> AsyncGenerator[FleetChange, None]:
        try:
            require_platform(info.context.auth)
            cursor = _start(after)
            text_args(region=region)
        except AppError as e:
            raise coded(e) from e

        def read(lo: int, hi: int, limit: int) -> list[FleetChange]:
            stmt = (
                select(HealthEvent, Node.name)
                .join(Node, Node.id == HealthEvent.node_id)
                .where(HealthEvent.id > lo, HealthEvent.id <= hi)
            )
            if region is not None:
                stmt = stmt.where(HealthEvent.region == region)
            with get_sessionmaker()() as s:
                rows = s.execute(stmt.order_by(HealthEvent.id).limit(limit)).all()
                return [_change(h, name) for h, name in rows]

        return _follow(
            info.context, require_platform, "health_events", FLEET_TOPIC.__eq__, read, cursor
        )


__all__ = ["FleetChange", "Subscription", "WorkloadEventUpdate", "on_ws_connect", "sign_in"]
