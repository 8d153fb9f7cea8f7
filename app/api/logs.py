"""Workload logs: node agents ship each replica's output (`POST /v1/agent/logs`, by node
credential); tenants read it, a page at a time or followed live as server-sent events
(`GET /v1/workloads/{id}/logs`, by API key)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.errors import AppError, ValidationFailed
from app.core.logging import get_logger
from app.core.middleware import RELEASE_SLOT
from app.core.routing import DbSession, api_router
from app.core.schemas import MAX_JSON_INT, QueryDatetime
from app.logs import follow as following
from app.logs import service
from app.logs.schemas import LogChunkOut, LogPage
from app.logs.service import DEFAULT_LIMIT, MAX_LIMIT, LogQuery
from app.tenancy.auth import TenantRead, credential_of
from app.tenancy.nodes import NodeAgent
from app.tenancy.principal import AuthContext, require_tenant_scope
from rackplane_wire import LogAck, LogBatch

log = get_logger(__name__)
# Full paths: the agent's route sits under /v1/agent, the tenants' under /v1/workloads.
router = api_router()

HEARTBEAT_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream
RETRY_MS = 3000  # what an EventSource waits before it reconnects


@router.post(
    "/v1/agent/logs",
    response_model=LogAck,
    tags=["agent"],
    summary="Output of the node's runs (batched), each chunk at its byte offset",
    description=(
        "Each chunk names its run (workload, attempt, replica) and where it starts in that "
        "run's output. A chunk about a run this node does not hold (no allocation of that "
        "replica for that attempt on it: another node's, or another attempt's) is counted as "
        "stale and dropped; a chunk sent again (same run and offset) is stored once, so a "
        "batch whose answer was lost may be sent again. A workload keeps its newest output "
        "up to a byte cap (`RACKPLANE_LOG_MAX_BYTES_PER_WORKLOAD`) for "
        "`RACKPLANE_LOG_RETENTION_HOURS`."
    ),
)
def post_logs(body: LogBatch, caller: NodeAgent, session: DbSession) -> LogAck:
    return service.ingest(session, caller, body)


def _last_event_id(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_JSON_INT:
        raise ValidationFailed(
            "Last-Event-ID is the id of a log chunk this stream sent (digits).",
            code="invalid_last_event_id",
            errors=[
                {
                    "field": "header.Last-Event-ID",
                    "message": "expected the id of a log chunk (digits)",
                    "type": "value_error",
                }
            ],
        )
    return int(value)


def _read(
    auth: AuthContext, workload_id: str, query: LogQuery, after: int | None, upto: int, limit: int
) -> LogPage:
    with session_scope() as session:
        return service.read(session, auth, workload_id, query, after=after, upto=upto, limit=limit)


def _sse(event: str, data: object, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _chunk_events(items: list[LogChunkOut]) -> str:
    return "".join(_sse("log", i.model_dump(mode="json"), i.id) for i in items)


@router.get(
    "/v1/workloads/{workload_id}/logs",
    response_model=LogPage,
    tags=["workloads"],
    summary="The workload's output: a page, or followed live (server-sent events)",
    description=(
        "Chunks of each replica's output (stdout and stderr together) in arrival order, after "
        "the chunk `after`. Without `follow`, a page (`next_after` reads on). With "
        "`follow=true`, `text/event-stream`: each chunk an event `log` whose `id` is the "
        "chunk's (a reconnecting client's `Last-Event-ID` resumes after it), as chunks arrive, "
        "a comment line every 15 s while quiet, and an event `end` (the workload's state) once "
        "the workload has ended and nothing new came for 2 s; an event `error` (a problem's "
        "code) if the key stops being valid meanwhile."
    ),
    responses={
        200: {
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string", "description": "with `follow=true`"}
                }
            }
        }
    },
)
async def workload_logs(
    workload_id: str,
    request: Request,
    auth: TenantRead,
    replica: int | None = Query(None, ge=0, le=4095, description="One replica's output only"),
    attempt: int | None = Query(
        None, ge=0, le=2**31 - 1, description="One run's output only (the workload's attempts)"
    ),
    since: QueryDatetime | None = Query(
        None, description="Only chunks the agent read at or after this instant (RFC 3339)"
    ),
    after: int | None = Query(
        None, ge=0, le=MAX_JSON_INT, description="The id of the last chunk read: what follows it"
    ),
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT, description="Chunks per page"),
    follow: bool = Query(False, description="Stream chunks as they arrive (text/event-stream)"),
    last_event_id: str | None = Header(
        None,
        alias="Last-Event-ID",
        max_length=20,
        description="An EventSource's reconnection: resume after this chunk (wins over `after`)",
    ),
):
    query = LogQuery(replica=replica, attempt=attempt, since=since)
    if not follow:
        upto = await following.horizon()
        return await run_in_threadpool(_read, auth, workload_id, query, after, upto, limit)
    resume = _last_event_id(last_event_id)
    # The first read before the answer starts: a refusal (404) is a problem, not a stream.
    first = await following.first_step(
        auth, workload_id, query, resume if resume is not None else after
    )
    return StreamingResponse(
        _stream(request, auth, query, first, resume if resume is not None else after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _stream(
    request: Request,
    auth: AuthContext,
    query: LogQuery,
    first: service.FollowStep,
    after: int | None,
) -> AsyncIterator[str]:
    """The event stream after its first read, until the client goes away (Starlette cancels
    it), the key stops, or the workload has ended and gone quiet."""
    release = request.scope.get("state", {}).get(RELEASE_SLOT)
    if release is not None:
        release()  # it mostly waits from now on: the in-flight bound is for work
    cred = credential_of(request)

    async def still_allowed() -> None:  # revoked, expired, its tenant suspended: the end
        if cred is not None:
            require_tenant_scope(await cred.resolve(), "read")

    cursor = first.page.items[-1].id if first.page.items else after
    try:
        yield f"retry: {RETRY_MS}\n\n" + _chunk_events(first.page.items)
        events = following.follow(
            auth, first.workload_id, query, cursor, idle_s=HEARTBEAT_S, still_allowed=still_allowed
        )
        async with aclosing(events):  # its waiter goes when the stream does, not at GC
            async for event in events:
                if isinstance(event, following.Ended):
                    yield _sse("end", {"state": event.state})
                    return
                if isinstance(event, following.Idle):
                    yield ": keep-alive\n\n"
                else:
                    yield _chunk_events(event)
    except AppError as e:  # the key stopped, the workload is gone: said, then the end
        yield _sse("error", {"code": e.code, "status": e.status, "detail": e.detail})
    except Exception as exc:  # the database went away mid-stream: the client reconnects
        log.warning("log_stream_failed", workload_id=str(first.workload_id), error=str(exc)[:300])
