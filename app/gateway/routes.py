"""The gateway's view of the endpoints: for each (tenant, name), its id, SLO kind, target and
ready replicas, read from the database every REFRESH_S (one query), so any number of gateways
agree within that without talking to each other."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from app.core.db import session_scope
from app.core.logging import get_logger
from app.models.endpoints import Endpoint
from app.models.workloads import State, Workload

log = get_logger(__name__)
REFRESH_S = 0.25


@dataclass(frozen=True)
class Replica:
    workload_id: uuid.UUID
    host: str
    port: int


@dataclass
class Route:
    endpoint_id: uuid.UUID
    name: str
    slo_kind: str  # p95 | ttft
    target: int
    replicas: list[Replica] = field(default_factory=list)


def read_routes() -> dict[tuple[uuid.UUID, str], Route]:
    """Every endpoint with its ready replicas (running, answering their readiness path)."""
    with session_scope() as session:
        eps = session.execute(
            select(
                Endpoint.id, Endpoint.tenant_id, Endpoint.name, Endpoint.slo_kind, Endpoint.target
            )
        ).all()
        ready = session.execute(
            select(Workload.endpoint_id, Workload.id, Workload.serve_host, Workload.serve_port)
            .where(
                Workload.endpoint_id.is_not(None),
                Workload.state == State.running.value,
                Workload.serve_ready_at.is_not(None),
                Workload.serve_host.is_not(None),
            )
            .order_by(Workload.id)
        ).all()
    by_id = {i: Route(i, name, kind, target) for i, _, name, kind, target in eps}
    for eid, wid, host, port in ready:
        if eid in by_id:
            by_id[eid].replicas.append(Replica(wid, host, port))
    return {(tenant, name): by_id[i] for i, tenant, name, _, _ in eps}


class RouteTable:
    """The routes, refreshed in the background; `changed` wakes requests held for a replica."""

    def __init__(self) -> None:
        self.routes: dict[tuple[uuid.UUID, str], Route] = {}
        self.changed = asyncio.Event()
        self.loaded = False
        self.read_at = -1.0  # when the last read began (monotonic)
        self._misses = asyncio.Lock()

    def get(self, tenant_id: uuid.UUID, name: str) -> Route | None:
        return self.routes.get((tenant_id, name))

    async def refresh(self) -> None:
        self.read_at = time.monotonic()
        self.routes = await run_in_threadpool(read_routes)
        self.loaded = True
        self.changed.set()
        self.changed = asyncio.Event()

    async def read_since(self, since: float) -> None:
        """Make sure the table was read after `since` (a request's arrival: an endpoint made
        just before it is seen). Reads for misses go one at a time, so a flood of calls to a
        name that is not there costs one query at a time, not one each."""
        async with self._misses:
            if self.read_at < since:
                await self.refresh()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh()
            except Exception as exc:  # the database away: keep the last table, try again
                log.warning("gateway_routes_unavailable", error=str(exc))
            try:
                await asyncio.wait_for(stop.wait(), REFRESH_S)
            except TimeoutError:
                pass
