"""The gateway's ASGI app: `/e/{endpoint}/{path}` to a ready replica of the caller's endpoint.

- Callers send a tenant API key with the `invoke` scope (`Authorization: Bearer rp_...`); the
  endpoint is looked up among that tenant's only, so another tenant's is a 404, as on REST.
- The replica with the fewest requests outstanding here takes the request. The body goes as it
  came; the answer comes back as it is produced (server-sent events and chunked streams are
  passed through, not buffered). The caller's key never reaches the replica.
- No replica ready (scaled to zero, or all starting): the request is held, at most
  `hold_s` seconds and `max_held` requests per endpoint, while the first replica starts
  (Knative's activator; the gateway asks the controller for one at once). Past either bound:
  503 or 429 with `Retry-After`.
- A replica that refuses the connection is skipped for a moment and the request goes to
  another; one that fails after taking the request (killed mid-answer) gives a 502 problem
  with `Retry-After` before any byte was sent, and a cut stream after (an SSE stream gets a
  last `event: error`). Never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route as Path

from app.core.config import get_settings
from app.core.db import session_scope, utcnow
from app.core.errors import AppError, problem_response
from app.core.logging import get_logger
from app.endpoints.service import wake
from app.gateway.routes import Replica, Route, RouteTable
from app.gateway.traffic import Traffic
from app.tenancy.auth import extract_key
from app.tenancy.principal import require_tenant_scope
from app.tenancy.principals import resolve_key

log = get_logger(__name__)
MAX_BODY_BYTES = 16 * 1024 * 1024
# Headers that belong to one hop, and the caller's credential: never forwarded.
_DROP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "authorization",
    "x-api-key", "cookie",
}  # fmt: skip
_DROP_BACK = _DROP - {"authorization", "x-api-key", "cookie"} | {"content-encoding"}
SKIP_REFUSING_S = 2.0  # a replica that refused a connection is left alone this long


class Gateway:
    def __init__(self, hold_s: float = 90.0, max_held: int = 256, name: str | None = None):
        self.hold_s, self.max_held = hold_s, max_held
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.table = RouteTable()
        self.traffic = Traffic(self.name)
        self.outstanding: dict[uuid.UUID, int] = {}  # replica -> requests it has from here
        self.refusing: dict[uuid.UUID, float] = {}  # replica -> skipped until (monotonic)
        self.held: dict[uuid.UUID, int] = {}
        self.woken: dict[uuid.UUID, float] = {}
        self.client: httpx.AsyncClient | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # --- lifetime --------------------------------------------------------------------------

    async def start(self) -> None:
        self._stop = asyncio.Event()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=None, write=30.0, pool=5.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256),
        )
        self._tasks = [
            asyncio.create_task(self.table.run(self._stop)),
            asyncio.create_task(self.traffic.run(self._stop)),
        ]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    # --- choosing a replica ----------------------------------------------------------------

    def _pick(self, route: Route, skip: set[uuid.UUID]) -> Replica | None:
        mono = time.monotonic()
        ready = [
            r
            for r in route.replicas
            if r.workload_id not in skip and self.refusing.get(r.workload_id, 0.0) <= mono
        ]
        if not ready:
            return None
        return min(ready, key=lambda r: (self.outstanding.get(r.workload_id, 0), r.workload_id))

    async def _wake(self, route: Route) -> None:
        """Ask for a first replica now (at most once a second per endpoint and gateway)."""
        mono = time.monotonic()
        if mono - self.woken.get(route.endpoint_id, -10.0) < 1.0:
            return
        self.woken[route.endpoint_id] = mono
        held = self.held.get(route.endpoint_id, 1)

        def act() -> bool:
            with session_scope() as session:
                return wake(session, route.endpoint_id, held, utcnow())

        try:
            if await run_in_threadpool(act):
                log.info("endpoint_woken", endpoint=str(route.endpoint_id), held=held)
        except Exception as exc:  # the controller's tick asks for it anyway
            log.warning("endpoint_wake_failed", endpoint=str(route.endpoint_id), error=str(exc))

    async def _replica(
        self, tenant: uuid.UUID, name: str, skip: set[uuid.UUID]
    ) -> tuple[Route | None, Replica | None, str]:
        """A ready replica of the endpoint, waiting for one while the bounds allow; the route,
        the replica, and why there is none (`held_too_long`, `too_many_held`)."""
        route = self.table.get(tenant, name)
        if route is None:
            return None, None, "endpoint_not_found"
        replica = self._pick(route, skip)
        if replica is not None:
            return route, replica, ""
        eid = route.endpoint_id
        if self.held.get(eid, 0) >= self.max_held:
            return route, None, "too_many_held"
        self.held[eid] = self.held.get(eid, 0) + 1
        deadline = time.monotonic() + self.hold_s
        try:
            while True:
                if not route.replicas:
                    await self._wake(route)
                left = deadline - time.monotonic()
                if left <= 0:
                    return route, None, "held_too_long"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.table.changed.wait(), min(left, 1.0))
                route = self.table.get(tenant, name)
                if route is None:
                    return None, None, "endpoint_not_found"
                replica = self._pick(route, skip)
                if replica is not None:
                    return route, replica, ""
        finally:
            self.held[eid] -= 1

    # --- requests --------------------------------------------------------------------------

    async def invoke(self, request: Request) -> Response:
        try:
            return await self._invoke(request)
        except AppError as e:
            return problem_response(
                e.status, e.code, e.title, e.detail, request, headers=e.headers or None, **e.extra
            )
        except Exception:  # a bug: a clear 502, never a 500 or a hung caller
            log.exception("gateway_failed", path=request.url.path)
            return problem_response(
                502, "gateway_error", "The gateway failed", "Try again.", request,
                headers={"Retry-After": "1"},
            )  # fmt: skip

    async def _invoke(self, request: Request) -> Response:
        arrived = time.monotonic()
        raw = extract_key(request)
        if raw is None:
            return problem_response(
                401, "missing_api_key", "Missing or invalid API key",
                "Send a key with the `invoke` scope as `Authorization: Bearer rp_...`.", request,
            )  # fmt: skip
        auth = await resolve_key(raw)
        require_tenant_scope(auth, "invoke")
        assert auth.tenant_id is not None
        name = request.path_params["endpoint"]
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return problem_response(
                413, "payload_too_large", "Request body too large",
                f"A request to an endpoint is at most {MAX_BODY_BYTES} bytes.", request,
            )  # fmt: skip
        route = self.table.get(auth.tenant_id, name)
        if route is None:  # made since the last refresh?
            await self.table.read_since(arrived)
            route = self.table.get(auth.tenant_id, name)
        if route is None:
            return problem_response(
                404, "endpoint_not_found", "Not found",
                f"You have no endpoint named {name!r}.", request,
            )  # fmt: skip
        eid = route.endpoint_id
        self.traffic.arrive(eid)
        began = time.monotonic()
        done = False
        try:
            response = await self._forward(request, auth.tenant_id, name, body, began)
            done = not isinstance(response, StreamingResponse)
            if done:
                self.traffic.leave(eid, response.status_code, None)
            return response
        except BaseException:
            if not done:
                self.traffic.leave(eid, 502, None)
            raise

    async def _forward(
        self, request: Request, tenant: uuid.UUID, name: str, body: bytes, began: float
    ) -> Response:
        skip: set[uuid.UUID] = set()
        for _ in range(3):  # a replica that refuses the connection: another one
            route, replica, why = await self._replica(tenant, name, skip)
            if replica is None or route is None:
                return self._none(request, why)
            url = f"http://{replica.host}:{replica.port}/{request.path_params['path']}"
            if request.url.query:
                url += f"?{request.url.query}"
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP]
            headers.append(("x-forwarded-for", request.client.host if request.client else ""))
            assert self.client is not None
            wid = replica.workload_id
            self.outstanding[wid] = self.outstanding.get(wid, 0) + 1
            try:
                upstream = await self.client.send(
                    self.client.build_request(request.method, url, headers=headers, content=body),
                    stream=True,
                )
            except httpx.ConnectError:
                self.outstanding[wid] -= 1
                self.refusing[wid] = time.monotonic() + SKIP_REFUSING_S
                skip.add(wid)
                continue
            except httpx.HTTPError as exc:
                self.outstanding[wid] -= 1
                return problem_response(
                    502, "replica_failed", "The replica failed",
                    "The replica serving this request failed before it answered "
                    f"({type(exc).__name__}); try again.", request, headers={"Retry-After": "1"},
                )  # fmt: skip
            return StreamingResponse(
                self._relay(upstream, route, wid, began),
                status_code=upstream.status_code,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_BACK},
            )
        return self._none(request, "replicas_refused")

    def _none(self, request: Request, why: str) -> Response:
        if why == "endpoint_not_found":
            return problem_response(404, why, "Not found", "The endpoint is gone.", request)
        if why == "too_many_held":
            return problem_response(
                429, "endpoint_busy", "Too many requests waiting",
                "The endpoint has no ready replica and as many requests waiting as it holds; "
                "try again shortly.", request, headers={"Retry-After": "2"},
            )  # fmt: skip
        return problem_response(
            503, "no_ready_replica", "No replica is ready",
            "No replica of the endpoint became ready in time (it may be starting, or at its "
            "max_replicas with every replica failing); try again shortly.", request,
            headers={"Retry-After": "5"},
        )  # fmt: skip

    async def _relay(
        self, upstream: httpx.Response, route: Route, wid: uuid.UUID, began: float
    ) -> AsyncIterator[bytes]:
        eid, first = route.endpoint_id, None
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        code = upstream.status_code
        try:
            async for chunk in upstream.aiter_raw():
                if first is None:
                    first = time.monotonic()
                yield chunk
        except httpx.HTTPError:
            code = 502
            log.warning("replica_cut", endpoint=str(eid), replica=str(wid))
            self.refusing[wid] = time.monotonic() + SKIP_REFUSING_S
            if sse:
                yield b'event: error\ndata: {"code": "replica_failed", "retry_after": 1}\n\n'
        finally:
            self.outstanding[wid] = max(0, self.outstanding.get(wid, 1) - 1)
            await upstream.aclose()
            end = time.monotonic()
            took = (first or end) - began if route.slo_kind == "ttft" else end - began
            self.traffic.leave(eid, code, took if code < 500 else None)

    async def metrics(self, _request: Request) -> Response:
        return Response(generate_latest(self.traffic.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, _request: Request) -> Response:
        return PlainTextResponse("ok" if self.table.loaded else "starting",
                                 status_code=200 if self.table.loaded else 503)  # fmt: skip


def create_gateway() -> Starlette:
    settings = get_settings()
    gw = Gateway(hold_s=settings.gateway_hold_s, max_held=settings.gateway_max_held)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app = Starlette(
        routes=[
            Path("/e/{endpoint}/{path:path}", gw.invoke, methods=methods),
            Path("/metrics", gw.metrics, methods=["GET"]),
            Path("/healthz", gw.healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app
