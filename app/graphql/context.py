"""The per-request context: who is calling (the same AuthContext as REST), the request's
database session, and loaders built for this request (bound to the caller, so a loader can never
return another tenant's row)."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from fastapi import Depends
from graphql import GraphQLError
from sqlalchemy import func, select, true
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection
from strawberry.dataloader import DataLoader
from strawberry.fastapi import BaseContext

from app.core.db import session_dependency
from app.core.errors import AppError, Unauthorized
from app.fleet.service import holders
from app.models.fleet import Gpu, Rack, Region
from app.models.workloads import Workload, WorkloadEvent
from app.tenancy.auth import AuthContext, authenticate, charge_anonymous, credential_of
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


def coded(e: AppError) -> GraphQLError:
    """A service's refusal as a GraphQL error: REST's code and status in its extensions."""
    return GraphQLError(e.detail, extensions={"code": e.code, "status": e.status, **e.extra})


class Context(BaseContext):
    """Database work runs on the thread pool, never on the event loop (a slow bill must not
    stall every other request of the process), one piece at a time per context: the session is
    the context's, and sessions are not for two threads at once. `run` is that door."""

    def __init__(self, auth: AuthContext | None, session: Session):
        super().__init__()
        self._auth = auth
        self._auth_error: AppError | None = None  # a websocket's refused key, told on use
        self.session = session
        self.ws_scope: Any = None  # a websocket's ASGI scope (rate limits per operation)
        self.lock = asyncio.Lock()
        self.fresh_loaders()

    def fresh_loaders(self) -> None:
        """Loaders for one operation (a websocket's context lives for many: each operation
        reads the database as it is now, and caches nothing past its end)."""
        self.events = DataLoader(self._locked(self._load_events))
        # Operators' fleet views (the fields check the platform scope before loading).
        self.gpus = DataLoader(self._locked(self._load_gpus))
        self.holders = DataLoader(self._locked(self._load_holders))
        self.racks = DataLoader(self._locked(self._load_racks))

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the thread pool, alone on this context's session; a service's
        refusal (AppError) becomes the GraphQL error with REST's code (and status)."""
        async with self.lock:
            try:
                return await run_in_threadpool(fn, *args)
            except AppError as e:
                raise coded(e) from e

    def _locked(self, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        async def load(keys: list[Any]) -> Any:
            return await self.run(fn, keys)

        return load

    @property
    def caller(self) -> AuthContext | None:
        """The authenticated caller, or None (anonymous, or a websocket whose key was refused)."""
        return self._auth

    @property
    def auth(self) -> AuthContext:
        if self._auth is None:
            if self._auth_error is not None:
                raise self._auth_error
            raise Unauthorized(
                "Send an API key as `Authorization: Bearer rp_...`.", code="missing_api_key"
            )
        return self._auth

    def _load_events(self, ids: list[uuid.UUID]) -> list[list[Any]]:
        by = self.newest_events(ids)
        return [by.get(i, []) for i in ids]

    def newest_events(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[Any]]:
        """The newest events of each workload (oldest first), in one statement, through the
        tenant scope: rows, not ORM objects (a page of 50 workloads is 1,000 events at most;
        as objects they, and the aliased entity the query needed, were cyclic garbage that
        only full collections freed)."""
        by: dict[uuid.UUID, list[Any]] = defaultdict(list)
        if not ids:
            return by
        if self.session.get_bind().dialect.name == "postgresql":
            # Per workload, its newest events by the (workload, seq) index: a LATERAL join
            # reads 20 rows a workload, however long its history. The owned workloads are
            # the scoped part; the lateral subquery is built once.
            stmt = restrict(
                self.auth,
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
                self.auth,
                select(*_EVENT_COLUMNS, rank).where(WorkloadEvent.workload_id.in_(ids)),
                WorkloadEvent,
            ).subquery()
            stmt = (
                select(*[ranked.c[c.key] for c in _EVENT_COLUMNS])
                .where(ranked.c.rank <= EVENTS_PER_WORKLOAD)
                .order_by(ranked.c.workload_id, ranked.c.seq)
            )
        for e in self.session.execute(stmt):
            by[e.workload_id].append(e)
        return by

    def _load_gpus(self, node_ids: list[uuid.UUID]) -> list[list[Any]]:
        by: dict[uuid.UUID, list[Any]] = defaultdict(list)
        for g in self.session.execute(  # rows, not objects: the fleet view reads hundreds
            select(Gpu.node_id, Gpu.index, Gpu.model, Gpu.health, Gpu.health_reason, Gpu.perf)
            .where(Gpu.node_id.in_(node_ids))
            .order_by(Gpu.node_id, Gpu.index)
        ):
            by[g.node_id].append(g)
        return [by.get(i, []) for i in node_ids]

    def _load_holders(self, node_ids: list[uuid.UUID]) -> list[dict[int, list[dict]]]:
        held = holders(self.session, node_ids)
        by: dict[uuid.UUID, dict[int, list[dict]]] = defaultdict(dict)
        for (node_id, index), hs in held.items():
            by[node_id][index] = hs
        return [by.get(i, {}) for i in node_ids]

    def _load_racks(self, rack_ids: list[uuid.UUID]) -> list[tuple[str, str]]:
        names = {
            rid: (rack, region)
            for rid, rack, region in self.session.execute(
                select(Rack.id, Rack.name, Region.name)
                .join(Region, Rack.region_id == Region.id)
                .where(Rack.id.in_(rack_ids))
            )
        }
        return [names.get(i, ("", "")) for i in rack_ids]


async def get_context(
    request: HTTPConnection, session: Session = Depends(session_dependency)
) -> Context:
    """The caller from the same API keys as REST. Without a key the context has no caller:
    GraphiQL's page loads, and every field that needs one answers `missing_api_key`. A
    websocket's key (its handshake's header, else its `connection_init` payload: see
    app/graphql/subscriptions.py) is checked when it connects; a refused one is the error of
    every operation on it, with REST's code, rather than a closed socket."""
    if request.scope["type"] == "websocket":
        from app.graphql.subscriptions import sign_in

        context = Context(None, session)
        cred = credential_of(request)
        if cred is not None:
            await sign_in(context, cred, request.scope)
        return context
    if credential_of(request) is None:
        # Anonymous: its address pays for the request before anything is parsed or run.
        charge_anonymous(request)
        return Context(None, session)
    return Context(await authenticate(request), session)  # type: ignore[arg-type]
