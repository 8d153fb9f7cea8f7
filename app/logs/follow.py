"""Following a workload's log: what REST's event stream and GraphQL's subscription both run.

The source is the `workload_logs` table, read in id order through the tenant scope, and only
up to the log's settled horizon (app/core/logtail.py): a chunk with a lower id can commit after
a higher one (two agents of a gang writing at once), and a follower that had moved past it
would never see it. A commit's wake-up (`service.topic`, app/core/pubsub.py) says only that
something is new; a read every `POLL_S` covers a lost one. Each read is a short session on a
worker thread; nothing is held open while waiting.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from app.core import logtail, pubsub
from app.core.db import session_scope
from app.logs import service
from app.logs.schemas import LogChunkOut
from app.logs.service import LogQuery
from app.tenancy.principal import AuthContext

POLL_S = 5.0  # a read even without a wake-up (a lost message costs at most this)
QUIET_S = 2.0  # an ended workload is followed until nothing new came for this long
RECHECK_S = 30.0  # how often a follower's key is checked again
SETTLE_S = 1.0  # how long a one-off read waits for writes in flight below the newest row


@dataclass(frozen=True)
class Ended:
    """The workload has ended and its log has been quiet for `QUIET_S`: nothing more comes."""

    state: str


@dataclass(frozen=True)
class Idle:
    """Nothing new for `idle_s` (a stream's cue for a heartbeat)."""


# What a follower yields: new chunks (never an empty list), an idle tick, or the end.
Event = list[LogChunkOut] | Idle | Ended


async def horizon(settle_s: float = SETTLE_S) -> int:
    """The log's settled horizon as of now (the highest id at or below which no chunk can
    still appear), waiting up to `settle_s` for writes in flight below the newest row."""
    tail = logtail.tail(service.TABLE)
    start = time.monotonic()
    top, held = await tail.horizon(start)
    while held and time.monotonic() - start < settle_s:
        await asyncio.sleep(tail.GRACE_S)
        top, held = await tail.horizon(time.monotonic())
    return top


def _step(
    auth: AuthContext, workload_id: uuid.UUID | str, query: LogQuery, after: int | None, upto: int
) -> service.FollowStep:
    with session_scope() as session:
        return service.follow_step(session, auth, workload_id, query, after=after, upto=upto)


async def first_step(
    auth: AuthContext, workload_id: uuid.UUID | str, query: LogQuery, after: int | None
) -> service.FollowStep:
    """A follower's first read, to be made before a stream starts (so a refusal, 404, is the
    answer rather than an item): the page after `after` up to the horizon."""
    return await run_in_threadpool(_step, auth, workload_id, query, after, await horizon())


async def follow(
    auth: AuthContext,
    workload_id: uuid.UUID,
    query: LogQuery,
    after: int | None,
    *,
    until_ended: bool = True,
    idle_s: float | None = None,
    still_allowed: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[Event]:
    """The workload's chunks after the chunk `after` (None: from the oldest kept), as they
    arrive, for as long as the consumer reads; with `until_ended`, an `Ended` once the workload
    has ended and nothing new came for `QUIET_S`. `Idle` after `idle_s` without chunks (None:
    never). `still_allowed` is awaited every `RECHECK_S` and ends the follower by raising."""
    tail = logtail.tail(service.TABLE)
    waiter = pubsub.hub.register_topic(service.topic(workload_id))
    now = time.monotonic()
    since, checked, sent = now, now, now
    quiet_from: float | None = None
    cursor = after
    try:
        while True:  # the first read at once: what committed before the waiter existed
            waiter.clear()  # before the read: a commit after it wakes the wait below
            top, held = await tail.horizon(max(since, waiter.woken_at))
            if held:  # writes in flight below the newest row: let them land first
                await asyncio.sleep(tail.GRACE_S)
                top, _ = await tail.horizon(time.monotonic())
            step = await run_in_threadpool(_step, auth, workload_id, query, cursor, top)
            now = time.monotonic()
            if step.page.items:
                cursor = step.page.items[-1].id
                sent, quiet_from = now, None
                yield step.page.items
            if step.more:
                continue
            ended = service.ended(step.state)
            if ended and until_ended:
                quiet_from = now if quiet_from is None else quiet_from
                if now - quiet_from >= QUIET_S:
                    yield Ended(step.state)
                    return
            if still_allowed is not None and now - checked >= RECHECK_S:
                checked = now
                await still_allowed()
            if idle_s is not None and now - sent >= idle_s:
                sent = now
                yield Idle()
            wait = POLL_S
            if idle_s is not None:
                wait = min(wait, idle_s - (now - sent))
            if ended and until_ended:
                wait = min(wait, QUIET_S / 4)
            woken = await waiter.wait(max(wait, 0.05))
            # Woken: a read that starts after the wake-up sees what woke it. Not: a poll.
            since = 0.0 if woken else time.monotonic()
    finally:
        pubsub.hub.unregister(waiter)
