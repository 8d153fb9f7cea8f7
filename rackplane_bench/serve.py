"""`rackplane bench serve`: what each autoscaling policy costs and keeps of an endpoint's SLO
over a day of traffic (issue 47 §4).

One arrival trace, replayed against each policy in this process, on the same fleet:

- **The day** (`Day`): a night's trickle, a morning ramp to the peak, a burst of `burst_x`
  times the peak for `burst_s`, an afternoon plateau, an evening fall, quiet again: Poisson
  arrivals at that rate, each request a number of tokens to generate (uniform in `tokens`).
  The day is compressed (`day_s` seconds of simulated time), as the windows of the policies
  are not: they see the same seconds a real endpoint would.
- **A replica** serves as `examples/serve.py` does (continuous batching): at most `max_batch`
  sequences at once, each step of a batch of b taking `token_ms * (1 + batch_cost * (b - 1))`,
  every sequence in it advancing one token (processor sharing; the rest wait in its queue).
  `calibrate` measures token_ms and batch_cost from a real `examples/serve.py` first (batch of
  one, then of eight) unless they are given. The gateway sends each request to the replica
  with the fewest outstanding, as `app/gateway` does.
- **Starting a replica** takes `cold_start_s` (placement, the agent's start, the server's load),
  during which it holds its GPU and serves nothing. A replica scaled down finishes what it has
  (the gateway stops sending it work first).
- **The fleet** has `gpus` GPUs; what replicas do not hold, preemptible training uses. A
  replica that needs a GPU training holds preempts it: the work since that job's last
  checkpoint (uniform in `checkpoint_s`) plus its grace is lost (`training_goodput_lost_gpu_h`).
- **The policies** are app/endpoints/autoscale.py's, the ones the controller runs:
  `static-peak` (max_replicas all day), `qps` (SkyServe's request-rate autoscaler with its
  upscale and downscale delays) and `rackplane` (Knative's KPA on concurrency with the SLO
  guard), each deciding once a second on what a gateway would have seen.

Reported per policy: `slo_attainment` (share of requests whose latency is within the SLO),
`gpu_hours` (replicas' GPU-hours: what would be billed), `cold_start_p50_s` (a request's wait
for a replica when none could take it), `training_goodput_lost_gpu_h`, and the p95 latency."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.core.config import get_settings
from app.endpoints.autoscale import Bounds, Kpa, QpsPolicy, Sample, StaticPeak
from rackplane_bench.deploy import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "examples" / "serve.py"
POLICIES = ("static-peak", "qps", "rackplane")


@dataclass(frozen=True)
class Day:
    day_s: float = 14_400.0  # simulated seconds
    night_rps: float = 0.05
    peak_rps: float = 8.0
    burst_x: float = 2.0
    burst_s: float = 300.0
    tokens: tuple[int, int] = (32, 192)

    def rps(self, t: float) -> float:
        """The arrival rate at `t`: quiet, ramp, peak with a burst, plateau, fall, quiet."""
        f = t / self.day_s
        if f < 0.15 or f >= 0.9:
            return self.night_rps
        if f < 0.35:  # the morning ramp
            return self.night_rps + (self.peak_rps - self.night_rps) * (f - 0.15) / 0.2
        burst_at = 0.45 * self.day_s
        if burst_at <= t < burst_at + self.burst_s:
            return self.peak_rps * self.burst_x
        if f < 0.6:
            return self.peak_rps
        if f < 0.75:  # the afternoon plateau, lower
            return self.peak_rps * 0.6
        return self.peak_rps * 0.6 * (0.9 - f) / 0.15 + self.night_rps  # the evening fall

    def arrivals(self, seed: int) -> list[tuple[float, int]]:
        """(time, tokens) of every request of the day (thinning a Poisson process)."""
        rng = random.Random(seed)
        top = max(self.peak_rps * self.burst_x, self.night_rps)
        out, t = [], 0.0
        while True:
            t += rng.expovariate(top)
            if t >= self.day_s:
                return out
            if rng.random() < self.rps(t) / top:
                out.append((t, rng.randint(*self.tokens)))


@dataclass(frozen=True)
class Model:
    token_ms: float = 20.0
    batch_cost: float = 0.05
    max_batch: int = 16

    def rate(self, batch: int) -> float:
        """Tokens a second each sequence of a batch of `batch` gets."""
        return 1000.0 / (self.token_ms * (1 + self.batch_cost * (max(batch, 1) - 1)))


@dataclass
class _Replica:
    ready_at: float
    draining: bool = False
    running: dict[int, float] = field(default_factory=dict)  # request -> tokens left
    waiting: list[int] = field(default_factory=list)
    last: float = 0.0  # when `running` was last advanced

    @property
    def outstanding(self) -> int:
        return len(self.running) + len(self.waiting)


@dataclass
class Result:
    policy: str
    slo_attainment: float
    gpu_hours: float
    cold_start_p50_s: float
    training_goodput_lost_gpu_h: float
    latency_p95_ms: float
    requests: int
    replicas_max: int
    preemptions: int

    def doc(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "slo_attainment": round(self.slo_attainment, 5),
            "gpu_hours": round(self.gpu_hours, 3),
            "cold_start_p50_s": round(self.cold_start_p50_s, 2),
            "training_goodput_lost_gpu_h": round(self.training_goodput_lost_gpu_h, 3),
            "latency_p95_ms": round(self.latency_p95_ms, 1),
            "requests": self.requests,
            "replicas_max": self.replicas_max,
            "preemptions": self.preemptions,
        }


def _setting(name: str):
    """The controller's own setting (app/core/config.py), as the default of the bench's."""
    return field(default_factory=lambda: getattr(get_settings(), name))


@dataclass(frozen=True)
class Setup:
    slo_ms: float = 8000.0
    min_replicas: int = 0
    max_replicas: int = 8
    # The same load per replica for both signals: at 8 requests in flight a replica answers
    # about 2 a second (Little's law at the ~4 s its answers take then).
    target_concurrency: float = 8.0
    target_qps: float = 2.0
    cold_start_s: float = 20.0
    checkpoint_s: float = 600.0
    grace_s: float = 30.0
    stable_window_s: float = _setting("endpoint_stable_window_s")
    panic_window_s: float = _setting("endpoint_panic_window_s")
    scale_down_delay_s: float = _setting("endpoint_scale_down_delay_s")


def _policy(name: str, s: Setup):
    bounds = Bounds(s.min_replicas, s.max_replicas)
    if name == "static-peak":
        return StaticPeak(bounds)
    if name == "qps":
        return QpsPolicy(bounds, s.target_qps)
    return Kpa(
        bounds,
        s.target_concurrency,
        s.slo_ms,
        stable_window_s=s.stable_window_s,
        panic_window_s=s.panic_window_s,
        scale_down_delay_s=s.scale_down_delay_s,
    )


@dataclass(eq=False)
class _Replay:
    """What the replay's loop carries: the replicas, each request's start and latency, the
    requests held for a replica, the gateway's samples, and the running totals."""

    name: str
    model: Model
    setup: Setup
    arrivals: list[tuple[float, int]]
    rng: random.Random
    policy: StaticPeak | QpsPolicy | Kpa
    tokens: list[int] = field(init=False)
    replicas: list[_Replica] = field(default_factory=list)
    started: dict[int, float] = field(default_factory=dict)
    latency: dict[int, float] = field(default_factory=dict)
    waited: list[float] = field(default_factory=list)  # a wait for a first ready replica
    held: list[int] = field(default_factory=list)  # requests no replica could take yet
    samples: list[Sample] = field(default_factory=list)
    gpu_s: float = 0.0
    lost_gpu_s: float = 0.0
    preemptions: int = 0
    most: int = 0
    next_arrival: int = 0
    arrived_in_tick: int = 0
    done_in_tick: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [n for _, n in self.arrivals]

    # --- a replica ----------------------------------------------------------------------------

    def advance(self, r: _Replica, until: float) -> list[tuple[float, int]]:
        """Run replica `r` to `until`; the requests it finished, with when."""
        model, tokens = self.model, self.tokens
        finished = []
        t = max(r.last, r.ready_at)
        while r.running and t < until:
            rate = model.rate(len(r.running))
            rid, left = min(r.running.items(), key=lambda kv: kv[1])
            at = t + left / rate
            if at > until:
                step = (until - t) * rate
                for k in r.running:
                    r.running[k] -= step
                t = until
                break
            for k in r.running:
                r.running[k] -= left
            del r.running[rid]
            finished.append((at, rid))
            t = at
            while r.waiting and len(r.running) < model.max_batch:
                nxt = r.waiting.pop(0)
                r.running[nxt] = float(tokens[nxt])
        r.last = until
        return finished

    def finish(self, r: _Replica, until: float) -> None:
        """Run replica `r` to `until`, recording the latency of what it finished."""
        for fin_at, rid in self.advance(r, until):
            self.latency[rid] = (fin_at - self.started[rid]) * 1000
            self.done_in_tick.append(self.latency[rid])

    def admit(self, r: _Replica, rid: int, now: float) -> None:
        """Request `rid` joins replica `r`'s batch, or its queue when the batch is full."""
        if len(r.running) < self.model.max_batch and now >= r.ready_at:
            r.running[rid] = float(self.tokens[rid])
        else:
            r.waiting.append(rid)

    def route(self, rid: int, now: float) -> bool:
        """The gateway: to the ready replica with the fewest outstanding; False when none is."""
        ready = [r for r in self.replicas if not r.draining and r.ready_at <= now]
        if not ready:
            return False
        self.admit(min(ready, key=lambda r: r.outstanding), rid, now)
        return True

    # --- a tick, in its steps -------------------------------------------------------------------

    def arrive(self, end: float) -> None:
        """Arrivals before `end` go to a replica at once, or are held."""
        arrivals = self.arrivals
        while self.next_arrival < len(arrivals) and arrivals[self.next_arrival][0] < end:
            at, _ = arrivals[self.next_arrival]
            for r in self.replicas:
                self.finish(r, at)
            self.started[self.next_arrival] = at
            self.arrived_in_tick += 1
            if not self.route(self.next_arrival, at):
                self.held.append(self.next_arrival)
            self.next_arrival += 1

    def serve(self, end: float) -> None:
        """Every replica runs to `end`; waiting requests fill the batches as they free."""
        for r in self.replicas:
            self.finish(r, end)
            # Waiting requests fill the batch as it frees (a step's granularity is below a tick).
            while r.waiting and len(r.running) < self.model.max_batch and r.ready_at <= end:
                rid = r.waiting.pop(0)
                r.running[rid] = float(self.tokens[rid])

    def release_held(self, end: float) -> None:
        """Held requests go to the first ready replica."""
        still = []
        ready = [r for r in self.replicas if not r.draining and r.ready_at <= end]
        for rid in self.held:
            if ready:
                self.admit(min(ready, key=lambda r: r.outstanding), rid, end)
                self.waited.append(max(0.0, end - self.started[rid]))
            else:
                still.append(rid)
        self.held = still

    def sample(self, end: float) -> None:
        """What the gateway saw this tick: in flight, arrived, the p95 of what finished."""
        in_flight = sum(r.outstanding for r in self.replicas) + len(self.held)
        p95 = _p95(self.done_in_tick)
        self.samples.append(Sample(end, float(in_flight), float(self.arrived_in_tick), p95))
        self.samples = self.samples[-int(max(self.setup.stable_window_s, 1200.0)) - 5 :]
        self.arrived_in_tick, self.done_in_tick = 0, []

    def scale(self, end: float, tick: float) -> None:
        """The policy decides on what the gateway saw; the fleet follows."""
        setup = self.setup
        serving = [r for r in self.replicas if not r.draining]
        decision = self.policy.decide(end, self.samples, len(serving))
        want = decision.target
        if self.held and want == 0 and setup.max_replicas:
            want = 1  # the activator: a held request asks for a first replica at once
        if want > len(serving):
            for _ in range(want - len(serving)):
                self.replicas.append(_Replica(ready_at=end + setup.cold_start_s, last=end))
                # Training holds every GPU replicas do not: the one this replica takes is
                # preempted, and loses its work since its last checkpoint plus its grace.
                self.preemptions += 1
                self.lost_gpu_s += self.rng.uniform(0, setup.checkpoint_s) + setup.grace_s
        elif want < len(serving):
            # Let go of the least loaded first; they finish what they have.
            for r in sorted(serving, key=lambda r: r.outstanding)[: len(serving) - want]:
                r.draining = True
        self.replicas = [r for r in self.replicas if not (r.draining and not r.outstanding)]
        self.most = max(self.most, len(self.replicas))
        self.gpu_s += len(self.replicas) * tick

    # --- the day ------------------------------------------------------------------------------

    def run(self, day_s: float) -> None:
        """A tick a second until the day is over and nothing is left (or twice the day)."""
        tick = 1.0
        now = 0.0
        while now < day_s or any(r.outstanding for r in self.replicas) or self.held:
            end = now + tick
            self.arrive(end)
            self.serve(end)
            self.release_held(end)
            self.sample(end)
            self.scale(end, tick)
            now = end
            if now > day_s * 2:  # a policy that never serves what is held: stop the day
                break

    def result(self) -> Result:
        """The policy's figures over the day."""
        n = len(self.arrivals)
        slo_ms = self.setup.slo_ms
        within = sum(1 for rid in range(n) if self.latency.get(rid, math.inf) <= slo_ms)
        lat = sorted(self.latency.values())
        return Result(
            policy=self.name,
            slo_attainment=within / max(1, n),
            gpu_hours=self.gpu_s / 3600,
            cold_start_p50_s=statistics.median(self.waited) if self.waited else 0.0,
            training_goodput_lost_gpu_h=self.lost_gpu_s / 3600,
            latency_p95_ms=lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else math.inf,
            requests=n,
            replicas_max=self.most,
            preemptions=self.preemptions,
        )


def replay(
    name: str, day: Day, model: Model, setup: Setup, arrivals: list[tuple[float, int]], seed: int
) -> Result:
    """One policy over the day's arrivals (see the module's docstring)."""
    r = _Replay(name, model, setup, arrivals, random.Random(seed), _policy(name, setup))
    r.run(day.day_s)
    return r.result()


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


def calibrate(startup: float = 0.0) -> Model:
    """The capacity curve of a real examples/serve.py on this machine: the time a token takes
    in a batch of one, and in a batch of eight (whence batch_cost)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVE), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)

        def timed(batch: int, n: int = 50) -> float:
            import concurrent.futures

            body = {"prompt": "calibrate the rack", "max_tokens": n}
            began = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                list(
                    pool.map(
                        lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60),
                        range(batch),
                    )
                )
            return (time.monotonic() - began) * 1000 / n

        one = statistics.median(timed(1) for _ in range(3))
        eight = statistics.median(timed(8) for _ in range(3))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return Model(token_ms=one, batch_cost=max(0.0, (eight / one - 1) / 7))


def bench(
    day: Day,
    setup: Setup,
    model: Model | None = None,
    seed: int = 20261129,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Every policy over the same day; one document each (see the module's docstring)."""
    if model is None:
        model = calibrate()
        log(
            f"examples/serve.py: {model.token_ms:.1f} ms a token, batch cost {model.batch_cost:.3f}"
        )
    arrivals = day.arrivals(seed)
    log(f"{len(arrivals)} requests over {day.day_s:.0f} s")
    out = []
    for name in POLICIES:
        began = time.monotonic()
        result = replay(name, day, model, setup, arrivals, seed)
        log(f"{name}: {result.doc()} ({time.monotonic() - began:.1f} s)")
        out.append(
            {**result.doc(), "token_ms": round(model.token_ms, 2), "batch_cost": model.batch_cost}
        )
    return out
