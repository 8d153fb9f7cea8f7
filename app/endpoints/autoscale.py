"""How many replicas an inference endpoint should have now (issue 47 §3): pure functions of the
load its gateways observed, no I/O. Three policies, one interface (`Policy.decide`):

- `StaticPeak`: always `max_replicas` (the baseline that never misses for want of replicas and
  pays for the peak all day).
- `QpsPolicy`: SkyServe's request-rate autoscaler: `ceil(rps / target_qps_per_replica)` over a
  window, applied only once it has held for `upscale_delay_s` (up) or `downscale_delay_s`
  (down).
- `Kpa`: Knative's pod autoscaler on concurrency (Ray Serve's `target_ongoing_requests`): the
  average in-flight requests over a stable window (60 s) divided by the target per replica;
  over a short panic window (6 s) too, and when that asks for at least twice the replicas
  there are, it panics: scales up at once to what the panic window asks and does not scale
  down until the burst has been over for a stable window. Down only by the highest target of
  the last `scale_down_delay_s`; to zero only after a stable window with no request. With an
  SLO, a p95 above it over the panic window adds replicas in proportion (the SLO is what is
  sold; concurrency is how to get there).

A decision carries the inputs it was made from, recorded as the endpoint's event."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """What the gateways saw of an endpoint over one tick ending at `at` (seconds)."""

    at: float
    concurrency: float  # average requests in flight
    rps: float  # requests that arrived per second
    p95_ms: float | None = None  # latency (or time to first token) of those that ended


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int

    def clip(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class Decision:
    target: int
    mode: str  # stable | panic | hold | static
    inputs: dict = field(default_factory=dict)


def _window(samples: Sequence[Sample], now: float, span: float) -> list[Sample]:
    return [s for s in samples if now - span < s.at <= now]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class StaticPeak:
    name = "static-peak"

    def __init__(self, bounds: Bounds):
        self.bounds = bounds

    def decide(self, now: float, samples: Sequence[Sample], current: int) -> Decision:
        return Decision(self.bounds.max_replicas, "static", {})


class QpsPolicy:
    """SkyServe's `RequestRateAutoscaler`."""

    name = "qps"

    def __init__(
        self,
        bounds: Bounds,
        target_qps_per_replica: float,
        window_s: float = 60.0,
        upscale_delay_s: float = 300.0,
        downscale_delay_s: float = 1200.0,
    ):
        self.bounds, self.target = bounds, target_qps_per_replica
        self.window_s = window_s
        self.up_s, self.down_s = upscale_delay_s, downscale_delay_s
        self._since: tuple[int, float] | None = None  # (direction, since when) while it differs

    def decide(self, now: float, samples: Sequence[Sample], current: int) -> Decision:
        recent = _window(samples, now, self.window_s)
        rps = _mean([s.rps for s in recent])
        wanted = self.bounds.clip(math.ceil(rps / self.target) if rps > 0 else 0)
        inputs = {"rps": round(rps, 3), "wanted": wanted}
        if wanted == current:
            self._since = None
            return Decision(current, "hold", inputs)
        direction = 1 if wanted > current else -1
        if self._since is None or self._since[0] != direction:
            self._since = (direction, now)
        delay = self.up_s if direction > 0 else self.down_s
        if now - self._since[1] >= delay:
            self._since = None
            return Decision(wanted, "stable", inputs)
        return Decision(current, "hold", {**inputs, "waiting_s": round(now - self._since[1], 1)})


class Kpa:
    """Knative's KPA on concurrency, with an SLO guard."""

    name = "rackplane"

    def __init__(
        self,
        bounds: Bounds,
        target_concurrency: float,
        slo_p95_ms: float | None = None,
        stable_window_s: float = 60.0,
        panic_window_s: float = 6.0,
        panic_threshold: float = 2.0,
        scale_down_delay_s: float = 30.0,
        metric: str = "concurrency",
    ):
        self.bounds, self.target, self.slo = bounds, target_concurrency, slo_p95_ms
        self.stable_s, self.panic_s = stable_window_s, panic_window_s
        self.panic_threshold, self.down_delay_s = panic_threshold, scale_down_delay_s
        # What a replica takes `target` of: `concurrency` (requests in flight) or `rps`
        # (Knative's KPA scales on either).
        self.metric = metric
        self._panic_until: float | None = None
        self._wanted: list[tuple[float, int]] = []  # (at, stable target) over the delay

    @property
    def memory(self) -> dict:
        """What it carries from one decision to the next (kept between a controller's ticks):
        nothing while it is at rest (no panic, and no target above zero to come down from)."""
        if self._panic_until is None and all(w == 0 for _, w in self._wanted):
            return {}
        return {"panic_until": self._panic_until, "wanted": [list(w) for w in self._wanted]}

    def recall(self, memory: dict) -> Kpa:
        """Take back what `memory` kept; returns itself."""
        self._panic_until = memory.get("panic_until")
        self._wanted = [(float(t), int(w)) for t, w in memory.get("wanted", [])]
        return self

    def decide(self, now: float, samples: Sequence[Sample], current: int) -> Decision:
        stable = _window(samples, now, self.stable_s)
        panic = _window(samples, now, self.panic_s)
        c_stable = _mean([getattr(s, self.metric) for s in stable])
        c_panic = _mean([getattr(s, self.metric) for s in panic])
        want_stable = math.ceil(c_stable / self.target) if c_stable > 0 else 0
        want_panic = math.ceil(c_panic / self.target) if c_panic > 0 else 0
        inputs: dict = {
            f"{self.metric}_stable": round(c_stable, 3),
            f"{self.metric}_panic": round(c_panic, 3),
            "want_stable": want_stable,
            "want_panic": want_panic,
        }
        # The SLO: a p95 over it in the panic window asks for replicas in proportion.
        p95s = [s.p95_ms for s in panic if s.p95_ms is not None]
        if self.slo and p95s and max(p95s) > self.slo and current > 0:
            over = max(p95s) / self.slo
            want_panic = max(want_panic, math.ceil(current * over))
            inputs["p95_ms"] = round(max(p95s), 1)
        if want_panic >= max(1, current) * self.panic_threshold or (current == 0 and want_panic):
            self._panic_until = now + self.stable_s
        if self._panic_until is not None and now >= self._panic_until:
            self._panic_until = None
        if self._panic_until is not None:
            target = self.bounds.clip(max(current, want_panic, want_stable))
            return Decision(target, "panic", inputs)
        # Down only by the highest stable target of the delay; to zero only after a stable
        # window without a request.
        # A sliding maximum: an earlier target no higher than a later one can never be the
        # maximum again, so only a falling staircase is kept (a few entries, not one a tick).
        self._wanted = [(t, w) for t, w in self._wanted if now - t < self.down_delay_s]
        while self._wanted and self._wanted[-1][1] <= want_stable:
            self._wanted.pop()
        self._wanted.append((now, want_stable))
        target = self._wanted[0][1]
        if target == 0 and any(s.rps > 0 or s.concurrency > 0 for s in stable):
            target = 1
        return Decision(self.bounds.clip(target), "stable", inputs)


def policy(name: str, bounds: Bounds, **kw) -> StaticPeak | QpsPolicy | Kpa:
    if name == "static-peak":
        return StaticPeak(bounds)
    if name == "qps":
        return QpsPolicy(bounds, kw["target_qps_per_replica"])
    if name == "rackplane":
        return Kpa(bounds, kw["target_concurrency"], kw.get("slo_p95_ms"))
    raise ValueError(f"no policy {name!r}")
