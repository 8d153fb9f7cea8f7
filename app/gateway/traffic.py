"""What the gateway sees of each endpoint: requests in flight (averaged over each second),
arrivals, and the latency (or time to first byte) of those that ended. Once a second it writes
one row per endpoint it saw (`EndpointSample`), which the controller sums over gateways; and
Prometheus reads the same counts on /metrics."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.concurrency import run_in_threadpool

from app.core.db import insert_objects, session_scope
from app.core.logging import get_logger
from app.models.endpoints import EndpointSample

log = get_logger(__name__)


@dataclass
class _Second:
    arrivals: int = 0
    # The integral of in-flight requests over the second (request-seconds), and from when.
    area: float = 0.0
    since: float = field(default_factory=time.monotonic)
    latencies_ms: list[float] = field(default_factory=list)


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


class Traffic:
    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.in_flight: dict[uuid.UUID, int] = {}
        self._seconds: dict[uuid.UUID, _Second] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rackplane_gateway_requests",
            "Requests the gateway answered, by endpoint and status",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.inflight_gauge = Gauge(
            "rackplane_gateway_in_flight",
            "Requests in flight, by endpoint",
            ["endpoint"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rackplane_gateway_latency_seconds",
            "A request's latency (or a stream's time to first byte, per the endpoint's SLO)",
            ["endpoint"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )

    def _second(self, eid: uuid.UUID) -> _Second:
        s = self._seconds.get(eid)
        if s is None:
            s = self._seconds[eid] = _Second()
        now = time.monotonic()
        s.area += self.in_flight.get(eid, 0) * (now - s.since)
        s.since = now
        return s

    def arrive(self, eid: uuid.UUID) -> None:
        self._second(eid).arrivals += 1
        self.in_flight[eid] = self.in_flight.get(eid, 0) + 1
        self.inflight_gauge.labels(str(eid)).inc()

    def leave(self, eid: uuid.UUID, code: int, latency_s: float | None) -> None:
        s = self._second(eid)
        self.in_flight[eid] = max(0, self.in_flight.get(eid, 0) - 1)
        self.inflight_gauge.labels(str(eid)).dec()
        self.requests.labels(str(eid), str(code)).inc()
        if latency_s is not None:
            s.latencies_ms.append(latency_s * 1000)
            self.latency.labels(str(eid)).observe(latency_s)

    def take(self) -> list[EndpointSample]:
        """The second that just ended, as one sample per endpoint seen (and the next begun)."""
        at = datetime.now(UTC).replace(microsecond=0)
        out = []
        for eid in list(self._seconds):
            s = self._second(eid)
            span = 1.0
            out.append(
                EndpointSample(
                    endpoint_id=eid,
                    gateway=self.gateway,
                    at=at,
                    in_flight=s.area / span,
                    arrivals=s.arrivals,
                    p95_ms=p95(s.latencies_ms),
                )
            )
            if self.in_flight.get(eid, 0) == 0 and not s.arrivals:
                del self._seconds[eid]  # quiet: not written again until it is seen
            else:
                self._seconds[eid] = _Second()
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Write a sample of each endpoint seen once a second, on the second."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0 - (time.time() % 1.0))
            except TimeoutError:
                pass
            rows = self.take()
            if not rows:
                continue
            try:
                await run_in_threadpool(_write, rows)
            except Exception as exc:  # the database away: this second is lost, not the gateway
                log.warning("gateway_samples_unwritten", error=str(exc), rows=len(rows))


def _write(rows: list[EndpointSample]) -> None:
    with session_scope() as session:
        insert_objects(session, rows)
