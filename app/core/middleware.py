"""Pure ASGI middleware: request ids, access logs and metrics, body size limits, a bound on
requests in flight, idempotent requests run again through a backing service's failover."""

from __future__ import annotations

import json
import time
import uuid

import anyio
import structlog
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from app.core.errors import PROBLEM_JSON, is_unavailable, problem_body
from app.core.logging import get_logger

REQUESTS = Counter("rackplane_http_requests_total", "HTTP requests", ["method", "route", "status"])
LATENCY = Histogram(
    "rackplane_http_request_duration_seconds",
    "HTTP request latency",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
log = get_logger("app.access")


async def send_problem(
    send: Send,
    status: int,
    code: str,
    title: str,
    detail: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    **extra,
) -> None:
    body = json.dumps(problem_body(status, code, title, detail, **extra)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", PROBLEM_JSON.encode()),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app a body already read, then defers to the real one."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class RequestContextMiddleware:
    """Assign a request id (or accept a sane X-Request-ID), bind it to every log line, return it,
    and record one access log line and Prometheus metrics per request."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not (0 < len(rid) <= 128 and rid.replace("-", "").replace("_", "").isalnum()):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=rid)
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            REQUESTS.labels(scope["method"], template, str(status)).inc()
            LATENCY.labels(scope["method"], template).observe(elapsed)
            log.info(
                "request",
                method=scope["method"],
                path=scope["path"],
                route=template,
                status=status,
                duration_ms=round(elapsed * 1000, 2),
            )


class BodySizeLimitMiddleware:
    """Reject bodies above the configured size with 413, whether or not Content-Length is sent."""

    def __init__(self, app: ASGIApp, max_bytes: int, large_paths: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.large_paths = large_paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.large_paths.get(scope["path"], self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_problem(
                send,
                413,
                "payload_too_large",
                "Request body too large",
                f"Request bodies are limited to {limit} bytes.",
            )
        if length is not None:  # the server enforces Content-Length, so the app may stream
            return await self.app(scope, receive, send)
        # Chunked body: buffer it (up to the limit) before the app sees it, so the answer is a
        # clean 413 rather than a half-read body.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await send_problem(
                    send,
                    413,
                    "payload_too_large",
                    "Request body too large",
                    f"Request bodies are limited to {limit} bytes.",
                )
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        await self.app(scope, replay_body(b"".join(chunks), receive), send)


IN_FLIGHT_WAIT = Histogram(
    "rackplane_http_queue_wait_seconds",
    "Time a request waited for an in-flight slot",
    buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10),
)
SHED = Counter("rackplane_http_shed_total", "Requests answered 503 after waiting for a slot")
# The request state's key of a callable that hands the request's in-flight slot back early.
RELEASE_SLOT = "release_in_flight_slot"


class ConcurrencyLimitMiddleware:
    """At most `limit` requests inside the app at once; the rest wait here, on the event loop,
    in arrival order, and get 503 problem+json with Retry-After if no slot frees in `timeout`
    seconds. Without it, a burst larger than the database pool deadlocks the sync handlers:
    threads block for a connection held by requests that wait for a thread to finish. Probes
    (`exempt`) are never queued, so liveness answers under load."""

    def __init__(
        self, app: ASGIApp, limit: int, timeout: float, exempt: frozenset[str] = frozenset()
    ):
        self.app = app
        self.slots = anyio.Semaphore(limit)
        self.timeout = timeout
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        with anyio.move_on_after(self.timeout) as waited:
            await self.slots.acquire()
        IN_FLIGHT_WAIT.observe(time.perf_counter() - start)
        if waited.cancelled_caught:
            SHED.inc()
            return await send_problem(
                send,
                503,
                "overloaded",
                "Service overloaded",
                f"No capacity to take the request within {self.timeout:g} s; retry shortly.",
                headers=[(b"retry-after", b"1")],
            )
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.slots.release()

        # A long-lived answer (a server-sent event stream) gives its slot back once it only
        # waits: it holds no connection while it waits, and must not starve other requests.
        scope.setdefault("state", {})[RELEASE_SLOT] = release
        try:
            await self.app(scope, receive, send)
        finally:
            release()


# Methods a server may run twice (RFC 9110 §9.2.2): the second run leaves what the first would.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


class TransientRetryMiddleware:
    """Run a request again when a backing service failed under it in a way that passes (a
    connection reset, a database failing over, no Redis master named yet), before any of the
    answer was sent, if its method is idempotent. A POST is not run again here, even with an
    Idempotency-Key (this runs inside the key's claim, so nothing would stop a second run after
    a COMMIT whose answer was lost): it gets the error handler's 503 with Retry-After, as does a
    failure that outlasts the attempts, and the client's retry with the same key is answered
    from the key's record (docs/ha.md)."""

    def __init__(self, app: ASGIApp, attempts: int = 3, max_wait: float = 1.0):
        self.app = app
        self.attempts = attempts
        self.max_wait = max_wait

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._safe(scope):
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            body.extend(message.get("body", b""))
            if not message.get("more_body"):
                break
        started = False

        async def guard(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        def again(exc: BaseException) -> bool:
            if started or not is_unavailable(exc):
                return False
            log.warning("transient_retry", path=scope["path"], error=repr(exc)[:300])
            return True

        retrying = AsyncRetrying(
            retry=retry_if_exception(again),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(multiplier=0.2, max=self.max_wait),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self.app(scope, replay_body(bytes(body), receive), guard)

    @staticmethod
    def _safe(scope: Scope) -> bool:
        return scope["method"] in IDEMPOTENT_METHODS
