"""MIG layouts by demand (docs/design/mig-layouts.md §5): a day-shifting mix of inference on
MIG slices and whole-GPU training, on one fleet under four layout policies.

**The trace** (seeded; built from the two public traces in shared/traces/):

- *Inference*, from openb: the fractional pods (`num_gpu=1, gpu_milli<1000`). The profile rule
  (`--mig-rule`, [assumption]) `round7`: compute slices = round(gpu_milli x 7/1000), at least 1;
  1-4 slices become 1g/2g/3g/4g, and a pod above 4.5/7 of a GPU would need a 7g, so it asks for a
  whole GPU instead (whole-GPU inference). Run times are openb's deletion - creation of those
  pods, at least a minute and cut at `max_inference_h` [assumption: the tail runs for months].
- *Training*, from Philly: jobs of at most 8 GPUs (one node), their GPU counts and durations,
  at least a minute and cut at `max_training_h` [assumption, same reason].
- *The day* [assumption: neither trace has a usable day curve]: arrivals are non-homogeneous
  Poisson with a sinusoidal rate. Inference peaks at 14:00, peak/trough `inference_peak_ratio`;
  training runs in antiphase (peak 02:00), peak/trough `training_peak_ratio`. The offered load is
  `load` x the fleet in GPU-equivalents, `inference_share` of it inference.
- Inference unserved after `patience_s` is dropped; training waits.

**The fleet and the core.** Whole-GPU work (training and whole-GPU inference) is placed by the
real queueing core: a `Snapshot` of the fleet and a `Scheduler` (allocate + backfill, priority
order: inference before training). A GPU with a MIG layout is in MIG mode in the snapshot, so the
core never places whole work on it. The core models a MIG GPU as free-form (an instance of any
profile that still fits is created on demand, `best_start`); it cannot yet say "this GPU has
exactly these instances". A laid-out GPU is therefore modelled here, beside the snapshot: its
instances, each free or held, and a MIG request takes a free instance of exactly its profile
(the fullest GPU first, so others empty out for re-layout), or waits. A re-laid GPU serves nothing
for its reset cost.

**Policies.** `static-none` (no MIG: MIG inference is never served), `static-1g` (a fraction f
of the nodes laid 7 x 1g), `static-balanced` (f laid {1g@0, 1g@1, 2g@2, 3g@4}) and `dynamic`
(static-balanced at its f, then `app.placement.miglayout.plan` every `plan_every_s`).

**Measured**: days 2..N (day 1 warms up). Served = GPU-equivalents (whole GPU 1, a slice its
memory slices / 8) x hours run inside the window.
"""

from __future__ import annotations

import csv
import heapq
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sortedcontainers import SortedList

from app.placement.isolation import Tier
from app.placement.mig import PROFILES, Layout
from app.placement.miglayout import Demand, GpuView, RelayoutConfig, plan
from app.placement.model import Request, Shape
from app.placement.queueing import QueueConfig, Scheduler, TenantQuota, Workload
from app.placement.snapshot import NodeSpec, Snapshot

DAY = 86400.0
MODEL = "H100-80GB"
GPUS_PER_NODE = 8
TENANT = "t"
BALANCED: Layout = (("1g", 0), ("1g", 1), ("2g", 2), ("3g", 4))
ONES: Layout = tuple(("1g", s) for s in range(7))
STATIC = {"static-none": None, "static-1g": ONES, "static-balanced": BALANCED}
POLICIES = ("dynamic", "static-none", "static-1g", "static-balanced")
MIG_RULES = ("round7",)
QUEUE = QueueConfig(phases=("allocate", "backfill"), order="priority", on_blocked="reserve")


@dataclass(frozen=True)
class Params:
    nodes: int = 32
    days: float = 3.0
    warmup_days: float = 1.0
    load: float = 1.0
    inference_share: float = 0.5
    inference_peak_ratio: float = 3.0
    training_peak_ratio: float = 1.5
    peak_hour: float = 14.0
    patience_s: float = 600.0
    max_inference_h: float = 2.0
    max_training_h: float = 6.0
    mig_rule: str = "round7"
    plan_every_s: float = 300.0
    seed: int = 1


@dataclass(frozen=True)
class Item:
    idx: int
    at: float
    duration: float
    kind: str  # "mig", "whole-inference", "training"
    gpus: int = 1
    profile: str | None = None

    @property
    def geq(self) -> float:
        if self.profile is not None:
            return PROFILES[self.profile].memory / 8
        return float(self.gpus)


def profile_of(milli: int, rule: str = "round7") -> str | None:
    """A fractional openb pod's MIG profile (None: it needs a whole GPU)."""
    if rule != "round7":
        raise ValueError(f"unknown MIG rule {rule!r}; known: {', '.join(MIG_RULES)}")
    slices = max(1, round(milli * 7 / 1000))
    return None if slices > 4 else f"{slices}g"


def inference_pool(path: Path, p: Params) -> list[tuple[str | None, float]]:
    out = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            if r["num_gpu"] != "1" or int(r["gpu_milli"]) >= 1000:
                continue
            dur = float(r["deletion_time"]) - float(r["creation_time"])
            dur = min(max(dur, 60.0), p.max_inference_h * 3600)
            out.append((profile_of(int(r["gpu_milli"]), p.mig_rule), dur))
    return out


def training_pool(path: Path, p: Params) -> list[tuple[int, float]]:
    out = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            gpus = int(r["num_gpus"])
            if 1 <= gpus <= GPUS_PER_NODE:
                dur = min(max(float(r["duration"]), 60.0), p.max_training_h * 3600)
                out.append((gpus, dur))
    return out


def _shape(t: float, peak_hour: float, ratio: float) -> float:
    """Relative rate at time t: 1 +- a around the mean, peak at `peak_hour`, max/min = ratio."""
    a = (ratio - 1) / (ratio + 1)
    return 1 + a * math.cos(2 * math.pi * (t / 3600 - peak_hour) / 24)


@dataclass
class Trace:
    items: list[Item]
    mig_share_by_hour: list[float]  # MIG inference share of offered GPU-eq, by hour of day
    profile_mix: dict[str, float]


def build_trace(openb_pods: Path, philly_jobs: Path, p: Params) -> Trace:
    rng = np.random.default_rng(p.seed)
    gpus = p.nodes * GPUS_PER_NODE
    horizon = p.days * DAY
    inf = inference_pool(openb_pods, p)
    train = training_pool(philly_jobs, p)
    classes = []
    inf_work = statistics.fmean((PROFILES[k].memory / 8 if k else 1.0) * d for k, d in inf)
    train_work = statistics.fmean(g * d for g, d in train)
    classes.append(("inference", p.inference_share, inf_work, p.peak_hour, p.inference_peak_ratio))
    classes.append(
        ("training", 1 - p.inference_share, train_work, p.peak_hour - 12, p.training_peak_ratio)
    )
    items: list[tuple[float, str, int]] = []
    for name, share, work, peak, ratio in classes:
        if share <= 0:
            continue
        mean_rate = share * p.load * gpus / work  # arrivals per second
        top = mean_rate * _shape(peak * 3600, peak, ratio)
        t = 0.0
        while True:
            t += rng.exponential(1 / top)
            if t >= horizon:
                break
            if rng.random() * top <= mean_rate * _shape(t, peak, ratio):
                pool = inf if name == "inference" else train
                items.append((t, name, int(rng.integers(len(pool)))))
    items.sort()
    out: list[Item] = []
    by_hour = np.zeros((24, 2))
    for i, (t, name, j) in enumerate(items):
        if name == "inference":
            prof, dur = inf[j]
            kind = "mig" if prof else "whole-inference"
            it = Item(i, t, dur, kind, 1, prof)
        else:
            g, dur = train[j]
            it = Item(i, t, dur, "training", g)
        out.append(it)
        h = int(t // 3600) % 24
        by_hour[h, 1] += it.geq * it.duration
        if it.kind == "mig":
            by_hour[h, 0] += it.geq * it.duration
    hourly = [round(float(a / b), 3) if b else 0.0 for a, b in by_hour]
    migs = [it for it in out if it.kind == "mig"]
    mix = {
        k: round(sum(it.profile == k for it in migs) / max(1, len(migs)), 3)
        for k in ("1g", "2g", "3g", "4g")
    }
    return Trace(out, hourly, mix)


def fleet(nodes: int, mig_nodes: int) -> list[NodeSpec]:
    return [
        NodeSpec(
            f"n{i:03d}",
            MODEL,
            GPUS_PER_NODE,
            224_000,
            2_097_152,
            region="mig",
            rack=f"r{i // 8:02d}",
            mig_gpus=tuple(range(GPUS_PER_NODE)) if i < mig_nodes else (),
        )
        for i in range(nodes)
    ]


@dataclass
class Result:
    policy: str
    mig_fraction: float
    gpus: int
    measured_days: float
    served_gpu_s: float = 0.0
    served_by_kind: dict[str, float] = field(default_factory=dict)
    offered_gpu_s: float = 0.0
    offered_by_kind: dict[str, float] = field(default_factory=dict)
    carried_in_gpu_s: float = 0.0  # work waiting or running as the window opens (its rest)
    resets: int = 0
    dropped_inference: int = 0
    served_inference: int = 0
    waits: dict[str, list[float]] = field(default_factory=dict)
    training_backlog_gpus_at_end: int = 0
    mig_gpus_min: int = 0
    mig_gpus_max: int = 0
    changes: dict[int, list[float]] = field(default_factory=dict)  # GPU -> decision times
    seconds: float = 0.0

    def as_dict(self) -> dict:
        def p95(xs: list[float]) -> float:
            return round(sorted(xs)[int(0.95 * (len(xs) - 1))], 1) if xs else 0.0

        gpu_days = self.gpus * self.measured_days
        return {
            "policy": self.policy,
            "mig_fraction": round(self.mig_fraction, 4),
            "demand_served_gpu_hours": round(self.served_gpu_s / 3600, 1),
            "offered_gpu_hours": round(self.offered_gpu_s / 3600, 1),
            "carried_in_gpu_hours": round(self.carried_in_gpu_s / 3600, 1),
            "served_by_class_gpu_hours": {
                k: round(v / 3600, 1) for k, v in sorted(self.served_by_kind.items())
            },
            "offered_by_class_gpu_hours": {
                k: round(v / 3600, 1) for k, v in sorted(self.offered_by_kind.items())
            },
            "utilisation": round(self.served_gpu_s / (gpu_days * DAY), 4) if gpu_days else 0.0,
            "resets_per_gpu_day": round(self.resets / gpu_days, 3) if gpu_days else 0.0,
            "resets": self.resets,
            "dropped_inference": self.dropped_inference,
            "served_inference": self.served_inference,
            "p95_wait_s": {k: p95(v) for k, v in sorted(self.waits.items())},
            "training_backlog_gpus_at_end": self.training_backlog_gpus_at_end,
            "mig_gpus_range": [self.mig_gpus_min, self.mig_gpus_max],
            "seconds": round(self.seconds, 1),
        }


ARRIVE, FINISH_WHOLE, FINISH_MIG, RESET_DONE, DROP, PLAN = range(6)


@dataclass(eq=False)
class _Replay:
    """What the replay's loop carries: the fleet (the snapshot for whole work, the laid-out GPUs
    beside it), the queues, the events, and the result being filled."""

    policy: str
    p: Params
    cfg: RelayoutConfig
    res: Result
    snap: Snapshot
    sched: Scheduler
    w0: float  # the measured window
    w1: float
    ngpu: int
    layout: list[Layout | None]
    holder: list[list[bool]]  # per laid-out GPU, each instance held or free
    free: dict[str, SortedList]  # per profile, (-held, GPU, instance) of the free instances
    per_node: int = field(init=False)  # GPU slots per node: a flat index is node x this + slot
    held: list[int] = field(init=False)
    resetting: list[bool] = field(init=False)
    changed_at: list[float] = field(init=False)
    incoming: list[Layout | None] = field(init=False)  # a resetting GPU's target
    events: list[tuple[float, int, int, object]] = field(default_factory=list)
    seq: int = 0
    queues: dict[str, deque[Item]] = field(init=False)
    pending: dict[str, Workload] = field(default_factory=dict)
    running: dict[str, Workload] = field(default_factory=dict)
    items: dict[str, Item] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)  # item idx -> start (running items)
    whole_dirty: bool = False  # whole-GPU work or capacity changed: run a cycle

    def __post_init__(self) -> None:
        self.per_node = self.snap.max_gpus
        self.held = [0] * self.ngpu
        self.resetting = [False] * self.ngpu
        self.changed_at = [-math.inf] * self.ngpu
        self.incoming = [None] * self.ngpu
        self.queues = {k: deque() for k in PROFILES}

    # --- the laid-out GPUs ----------------------------------------------------------------------

    def index(self, flat: int, add: bool) -> None:
        """Add or remove a GPU's free instances in the per-profile indexes."""
        lay = self.layout[flat]
        for i, (key, _s) in enumerate(lay or ()):
            if not self.holder[flat][i]:
                entry = (-self.held[flat], flat, i)
                if add:
                    self.free[key].add(entry)
                else:
                    self.free[key].discard(entry)

    def push(self, t: float, kind: int, payload: object) -> None:
        """Schedule an event; at one instant, by kind, then in the order pushed."""
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))

    def served(self, it: Item, start: float) -> None:
        """An item starts at `start`: what it serves inside the window, its wait."""
        res, w0 = self.res, self.w0
        lo, hi = max(start, w0), min(start + it.duration, self.w1)
        if hi > lo:
            res.served_gpu_s += it.geq * (hi - lo)
            res.served_by_kind[it.kind] = res.served_by_kind.get(it.kind, 0.0) + it.geq * (hi - lo)
        if it.at >= w0:
            res.waits.setdefault(it.kind, []).append(start - it.at)
        if it.kind != "training":
            res.served_inference += it.at >= w0

    def take_instance(self, flat: int, i: int, it: Item, t: float) -> None:
        """A MIG request takes instance `i` of GPU `flat` until it finishes."""
        self.index(flat, False)
        self.holder[flat][i] = True
        self.held[flat] += 1
        self.index(flat, True)
        self.started[it.idx] = t
        self.served(it, t)
        self.push(t + it.duration, FINISH_MIG, (flat, i, it))

    def serve_queue(self, key: str, t: float) -> None:
        """Free instances of profile `key` to the queue's head (dropping what waited too long)."""
        q, free = self.queues[key], self.free[key]
        while q and free:
            it = q.popleft()
            if t - it.at > self.p.patience_s:
                self.res.dropped_inference += it.at >= self.w0
                continue
            _neg, flat, i = free[0]
            self.take_instance(flat, i, it, t)

    def mig_count(self) -> int:
        """GPUs laid out or being laid out."""
        return sum(1 for x in range(self.ngpu) if self.layout[x] is not None or self.resetting[x])

    # --- re-layout ------------------------------------------------------------------------------

    def start_reset(self, flat: int, target: Layout | None, t: float) -> None:
        """GPU `flat` starts its re-layout to `target`; it serves nothing until it is done."""
        n, s = divmod(flat, self.per_node)
        mode_flip = (self.layout[flat] is None) != (target is None)
        self.index(flat, False)
        if self.layout[flat] is None:
            self.snap.set_mig_mode(n, s, True)  # out of the whole pool from now on
            self.snap.commit()
        self.resetting[flat] = True
        self.incoming[flat] = target
        self.holder[flat] = []
        self.changed_at[flat] = t
        self.res.changes.setdefault(flat, []).append(t)
        if self.w0 <= t < self.w1:
            self.res.resets += 1
        cost = self.cfg.mode_flip_cost_s if mode_flip else self.cfg.reset_cost_s
        self.push(t + cost, RESET_DONE, (flat, target))

    def view(self, flat: int, t: float) -> GpuView:
        """What the planner sees of GPU `flat` at `t`."""
        snap = self.snap
        n, s = divmod(flat, self.per_node)
        c24 = sum(1 for x in self.res.changes.get(flat, ()) if t - x < DAY)
        lay: Layout | None
        if self.resetting[flat]:  # busy; its coming instances count as supply
            lay, idle, fr = self.incoming[flat], False, self.incoming[flat] or ()
        elif self.layout[flat] is None:
            lay, idle, fr = None, snap.is_whole_free(n, s), ()
        else:
            lay, idle = self.layout[flat], self.held[flat] == 0
            fr = tuple(x for x, h in zip(lay or (), self.holder[flat], strict=True) if not h)
        return GpuView(snap.node_names[n], s, MODEL, lay, idle, self.changed_at[flat], c24, fr)

    def relayout(self, t: float) -> None:
        """Views of every GPU and the live queues, through the planner; apply its decisions."""
        snap, per_node = self.snap, self.per_node
        views = [self.view(flat, t) for flat in range(self.ngpu)]
        whole_want = sum(self.items[w].gpus for w in self.pending)
        want_mig = {}
        for key, q in self.queues.items():
            live = sum(1 for it in q if t - it.at <= self.p.patience_s)
            if live:
                want_mig[(MODEL, key)] = live
        for r in plan(views, Demand({MODEL: whole_want}, want_mig), self.cfg, t):
            flat = snap.node_index[r.node] * per_node + r.index
            n, s = divmod(flat, per_node)
            if self.layout[flat] is not None:
                idle = self.held[flat] == 0
            else:
                idle = snap.is_whole_free(n, s)
            assert idle and not self.resetting[flat], "the planner picked a busy GPU"
            self.start_reset(flat, r.target, t)

    # --- the events, one handler per kind ---------------------------------------------------

    def on_arrive(self, t: float, payload: object) -> None:
        """MIG inference joins its profile's queue; whole-GPU work waits for the next cycle."""
        assert isinstance(payload, Item)
        it = payload
        if it.kind == "mig":
            assert it.profile is not None
            self.queues[it.profile].append(it)
            self.serve_queue(it.profile, t)
            return
        wid = f"i{it.idx}"
        prio = "production" if it.kind == "whole-inference" else "training"
        req = Request(wid, TENANT, Tier.DEDICATED, Shape(gpus=it.gpus))
        maxrt = math.ceil(it.duration * 1.25 / 60) * 60
        self.pending[wid] = Workload(wid, req, prio, it.at, maxrt)
        self.items[wid] = it
        self.whole_dirty = True
        if it.kind == "whole-inference":
            self.push(t + self.p.patience_s, DROP, wid)

    def on_finish_whole(self, t: float, payload: object) -> None:
        """Whole-GPU work ends: its GPUs go back to the snapshot."""
        assert isinstance(payload, str)
        w = self.running.pop(payload)
        for aid in w.alloc_ids:
            self.snap.release(aid)
        self.snap.commit()
        self.started.pop(self.items[payload].idx, None)
        self.whole_dirty = True

    def on_finish_mig(self, t: float, payload: object) -> None:
        """A MIG request ends: its instance is free for the queue of its profile."""
        assert isinstance(payload, tuple)
        flat, slot, it = payload
        assert it.profile is not None
        self.started.pop(it.idx, None)
        self.index(flat, False)
        self.holder[flat][slot] = False
        self.held[flat] -= 1
        self.index(flat, True)
        self.serve_queue(it.profile, t)

    def on_reset_done(self, t: float, payload: object) -> None:
        """A re-layout is done: the GPU serves its new instances, or whole work again."""
        assert isinstance(payload, tuple)
        flat, target = payload
        self.resetting[flat] = False
        self.layout[flat] = target
        if target is None:
            n, s = divmod(flat, self.per_node)
            self.snap.set_mig_mode(n, s, False)
            self.snap.commit()
            self.whole_dirty = True
        else:
            self.holder[flat] = [False] * len(target)
            self.index(flat, True)
            for key in {k for k, _s in target}:
                self.serve_queue(key, t)

    def on_drop(self, t: float, payload: object) -> None:
        """Whole-GPU inference past its patience is dropped; "window" opens the window."""
        res, items = self.res, self.items
        if payload == "window":  # what is still to run of work already there
            for wid in self.pending:
                res.carried_in_gpu_s += items[wid].geq * items[wid].duration
            for q in self.queues.values():
                res.carried_in_gpu_s += sum(x.geq * x.duration for x in q)
            for wid in self.running:
                it = items[wid]
                res.carried_in_gpu_s += it.geq * max(0.0, self.started[it.idx] + it.duration - t)
        elif payload in self.pending:
            assert isinstance(payload, str)
            del self.pending[payload]
            res.dropped_inference += items[payload].at >= self.w0

    def on_plan(self, t: float, payload: object) -> None:
        """The periodic tick: a cycle for waiting work, and the dynamic policy's plan."""
        if self.policy == "dynamic":
            self.relayout(t)
        self.whole_dirty = True
        self.push(t + self.p.plan_every_s, PLAN, None)

    # --- the loop -----------------------------------------------------------------------------

    def cycle(self, t: float) -> None:
        """One queueing cycle over the waiting whole-GPU work; start what it admits."""
        result = self.sched.cycle(t, list(self.pending.values()), list(self.running.values()))
        self.snap.commit()
        for adm in result.admissions:
            w = self.pending.pop(adm.workload)
            w.alloc_ids = tuple(b.alloc_id for b in adm.bindings)
            w.started_at = t
            self.running[adm.workload] = w
            it = self.items[adm.workload]
            self.started[it.idx] = t
            self.served(it, t)
            self.push(t + it.duration, FINISH_WHOLE, adm.workload)

    def run(self) -> None:
        """Every instant up to the window's end: its events, then a cycle if anything changed."""
        # Indexed by event kind (ARRIVE, FINISH_WHOLE, FINISH_MIG, RESET_DONE, DROP, PLAN).
        handlers = (
            self.on_arrive,
            self.on_finish_whole,
            self.on_finish_mig,
            self.on_reset_done,
            self.on_drop,
            self.on_plan,
        )
        events, res, dynamic = self.events, self.res, self.policy == "dynamic"
        while events:
            t = events[0][0]
            if t > self.w1:
                break
            while events and events[0][0] == t:
                _, kind, _, payload = heapq.heappop(events)
                handlers[kind](t, payload)
            if self.whole_dirty and self.pending:
                self.cycle(t)
            self.whole_dirty = False
            if dynamic:
                m = self.mig_count()
                res.mig_gpus_min = min(res.mig_gpus_min, m)
                res.mig_gpus_max = max(res.mig_gpus_max, m)

    def close(self) -> None:
        """What the replay's end leaves: queued MIG inference past its patience, the backlog."""
        res, w0, w1 = self.res, self.w0, self.w1
        # Queued MIG inference that waited past its patience when the replay ends: dropped too.
        for q in self.queues.values():
            res.dropped_inference += sum(
                1 for it in q if it.at >= w0 and w1 - it.at > self.p.patience_s
            )
        res.training_backlog_gpus_at_end = sum(
            self.items[w].gpus for w in self.pending if self.items[w].kind == "training"
        )


def _start(
    trace: Trace, policy: str, mig_fraction: float, p: Params, cfg: RelayoutConfig
) -> _Replay:
    """The fleet with `mig_fraction` of its nodes laid out, every arrival and the first ticks."""
    start_layout = BALANCED if policy == "dynamic" else STATIC[policy]
    mig_nodes = 0 if start_layout is None else round(mig_fraction * p.nodes)
    snap = Snapshot(fleet(p.nodes, mig_nodes))
    sched = Scheduler(snap, {TENANT: TenantQuota()}, QUEUE)
    sched.engine.allow_mig_reconfigure = False  # layouts change only by policy, below
    ngpu = p.nodes * GPUS_PER_NODE
    w0, w1 = p.warmup_days * DAY, p.days * DAY
    res = Result(policy, mig_nodes / p.nodes, ngpu, (w1 - w0) / DAY)
    layout: list[Layout | None] = [None] * ngpu
    holder: list[list[bool]] = [[] for _ in range(ngpu)]
    for flat in range(ngpu):
        if flat // snap.max_gpus < mig_nodes:
            layout[flat] = start_layout
            holder[flat] = [False] * len(start_layout or ())
    free: dict[str, SortedList] = {k: SortedList() for k in PROFILES}
    r = _Replay(policy, p, cfg, res, snap, sched, w0, w1, ngpu, layout, holder, free)
    for flat in range(ngpu):
        r.index(flat, True)
    for it in trace.items:
        r.push(it.at, ARRIVE, it)
        if w0 <= it.at < w1:
            res.offered_gpu_s += it.geq * it.duration
            res.offered_by_kind[it.kind] = (
                res.offered_by_kind.get(it.kind, 0.0) + it.geq * it.duration
            )
    # Every policy gets a cycle each `plan_every_s` while work waits (the queue's time-dependent
    # rules: backfill windows, starvation); the dynamic one also plans then.
    r.push(p.plan_every_s, PLAN, None)
    r.push(w0, DROP, "window")  # marks the window's start: carried-in work is counted there
    res.mig_gpus_min = res.mig_gpus_max = r.mig_count()
    return r


def replay(
    trace: Trace,
    policy: str,
    mig_fraction: float,
    p: Params,
    cfg: RelayoutConfig | None = None,
) -> Result:
    """One policy over the trace; `mig_fraction` of the nodes start laid out (see the module)."""
    wall = time.perf_counter()
    r = _start(trace, policy, mig_fraction, p, cfg or RelayoutConfig())
    r.run()
    r.close()
    r.res.seconds = time.perf_counter() - wall
    return r.res


__all__ = ["POLICIES", "Params", "Trace", "build_trace", "replay"]
