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


def replay(
    trace: Trace,
    policy: str,
    mig_fraction: float,
    p: Params,
    cfg: RelayoutConfig | None = None,
) -> Result:
    """One policy over the trace; `mig_fraction` of the nodes start laid out (see the module)."""
    wall = time.perf_counter()
    cfg = cfg or RelayoutConfig()
    start_layout = BALANCED if policy == "dynamic" else STATIC[policy]
    mig_nodes = 0 if start_layout is None else round(mig_fraction * p.nodes)
    snap = Snapshot(fleet(p.nodes, mig_nodes))
    sched = Scheduler(snap, {TENANT: TenantQuota()}, QUEUE)
    sched.engine.allow_mig_reconfigure = False  # layouts change only by policy, below
    G = snap.max_gpus
    ngpu = p.nodes * GPUS_PER_NODE
    w0, w1 = p.warmup_days * DAY, p.days * DAY
    res = Result(policy, mig_nodes / p.nodes, ngpu, (w1 - w0) / DAY)

    layout: list[Layout | None] = [None] * ngpu
    holder: list[list[bool]] = [[] for _ in range(ngpu)]
    held = [0] * ngpu
    resetting = [False] * ngpu
    changed_at = [-math.inf] * ngpu
    incoming: list[Layout | None] = [None] * ngpu  # a resetting GPU's target
    free: dict[str, SortedList] = {k: SortedList() for k in PROFILES}
    for flat in range(ngpu):
        if flat // G < mig_nodes:
            layout[flat] = start_layout
            holder[flat] = [False] * len(start_layout or ())

    def index(flat: int, add: bool) -> None:
        lay = layout[flat]
        for i, (key, _s) in enumerate(lay or ()):
            if not holder[flat][i]:
                entry = (-held[flat], flat, i)
                if add:
                    free[key].add(entry)
                else:
                    free[key].discard(entry)

    for flat in range(ngpu):
        index(flat, True)

    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, kind, seq, payload))

    for it in trace.items:
        push(it.at, ARRIVE, it)
        if w0 <= it.at < w1:
            res.offered_gpu_s += it.geq * it.duration
            res.offered_by_kind[it.kind] = (
                res.offered_by_kind.get(it.kind, 0.0) + it.geq * it.duration
            )
    # Every policy gets a cycle each `plan_every_s` while work waits (the queue's time-dependent
    # rules: backfill windows, starvation); the dynamic one also plans then.
    push(p.plan_every_s, PLAN, None)
    push(w0, DROP, "window")  # marks the window's start: carried-in work is counted there

    queues: dict[str, deque[Item]] = {k: deque() for k in PROFILES}
    pending: dict[str, Workload] = {}
    running: dict[str, Workload] = {}
    items: dict[str, Item] = {}
    started: dict[int, float] = {}  # item idx -> start (running items)

    def served(it: Item, start: float) -> None:
        lo, hi = max(start, w0), min(start + it.duration, w1)
        if hi > lo:
            res.served_gpu_s += it.geq * (hi - lo)
            res.served_by_kind[it.kind] = res.served_by_kind.get(it.kind, 0.0) + it.geq * (hi - lo)
        if it.at >= w0:
            res.waits.setdefault(it.kind, []).append(start - it.at)
        if it.kind != "training":
            res.served_inference += it.at >= w0

    def take_instance(flat: int, i: int, it: Item, t: float) -> None:
        index(flat, False)
        holder[flat][i] = True
        held[flat] += 1
        index(flat, True)
        started[it.idx] = t
        served(it, t)
        push(t + it.duration, FINISH_MIG, (flat, i, it))

    def serve_queue(key: str, t: float) -> None:
        q = queues[key]
        while q and free[key]:
            it = q.popleft()
            if t - it.at > p.patience_s:
                res.dropped_inference += it.at >= w0
                continue
            _neg, flat, i = free[key][0]
            take_instance(flat, i, it, t)

    def start_reset(flat: int, target: Layout | None, t: float) -> None:
        n, s = divmod(flat, G)
        mode_flip = (layout[flat] is None) != (target is None)
        index(flat, False)
        if layout[flat] is None:
            snap.set_mig_mode(n, s, True)  # out of the whole pool from now on
            snap.commit()
        resetting[flat] = True
        incoming[flat] = target
        holder[flat] = []
        changed_at[flat] = t
        res.changes.setdefault(flat, []).append(t)
        if w0 <= t < w1:
            res.resets += 1
        cost = cfg.mode_flip_cost_s if mode_flip else cfg.reset_cost_s
        push(t + cost, RESET_DONE, (flat, target))

    def mig_count() -> int:
        return sum(1 for x in range(ngpu) if layout[x] is not None or resetting[x])

    def _plan(t: float) -> None:
        """Views of every GPU and the live queues, through the planner; apply its decisions."""
        views = []
        for flat in range(ngpu):
            n, s = divmod(flat, G)
            c24 = sum(1 for x in res.changes.get(flat, ()) if t - x < DAY)
            lay: Layout | None
            if resetting[flat]:  # busy; its coming instances count as supply
                lay, idle, fr = incoming[flat], False, incoming[flat] or ()
            elif layout[flat] is None:
                lay, idle, fr = None, snap.is_whole_free(n, s), ()
            else:
                lay, idle = layout[flat], held[flat] == 0
                fr = tuple(x for x, h in zip(lay or (), holder[flat], strict=True) if not h)
            views.append(
                GpuView(snap.node_names[n], s, MODEL, lay, idle, changed_at[flat], c24, fr)
            )
        whole_want = sum(items[w].gpus for w in pending)
        want_mig = {}
        for key, q in queues.items():
            live = sum(1 for it in q if t - it.at <= p.patience_s)
            if live:
                want_mig[(MODEL, key)] = live
        for r in plan(views, Demand({MODEL: whole_want}, want_mig), cfg, t):
            flat = snap.node_index[r.node] * G + r.index
            n, s = divmod(flat, G)
            idle = held[flat] == 0 if layout[flat] is not None else snap.is_whole_free(n, s)
            assert idle and not resetting[flat], "the planner picked a busy GPU"
            start_reset(flat, r.target, t)

    res.mig_gpus_min = res.mig_gpus_max = mig_count()
    whole_dirty = False
    t = 0.0
    while events:
        t = events[0][0]
        if t > w1:
            break
        while events and events[0][0] == t:
            _, kind, _, payload = heapq.heappop(events)
            if kind == ARRIVE:
                assert isinstance(payload, Item)
                it = payload
                if it.kind == "mig":
                    assert it.profile is not None
                    queues[it.profile].append(it)
                    serve_queue(it.profile, t)
                else:
                    wid = f"i{it.idx}"
                    prio = "production" if it.kind == "whole-inference" else "training"
                    req = Request(wid, TENANT, Tier.DEDICATED, Shape(gpus=it.gpus))
                    maxrt = math.ceil(it.duration * 1.25 / 60) * 60
                    pending[wid] = Workload(wid, req, prio, it.at, maxrt)
                    items[wid] = it
                    whole_dirty = True
                    if it.kind == "whole-inference":
                        push(t + p.patience_s, DROP, wid)
            elif kind == FINISH_WHOLE:
                assert isinstance(payload, str)
                w = running.pop(payload)
                for aid in w.alloc_ids:
                    snap.release(aid)
                snap.commit()
                started.pop(items[payload].idx, None)
                whole_dirty = True
            elif kind == FINISH_MIG:
                assert isinstance(payload, tuple)
                flat, slot, it = payload
                assert it.profile is not None
                started.pop(it.idx, None)
                index(flat, False)
                holder[flat][slot] = False
                held[flat] -= 1
                index(flat, True)
                serve_queue(it.profile, t)
            elif kind == RESET_DONE:
                assert isinstance(payload, tuple)
                flat, target = payload
                resetting[flat] = False
                layout[flat] = target
                if target is None:
                    n, s = divmod(flat, G)
                    snap.set_mig_mode(n, s, False)
                    snap.commit()
                    whole_dirty = True
                else:
                    holder[flat] = [False] * len(target)
                    index(flat, True)
                    for key in {k for k, _s in target}:
                        serve_queue(key, t)
            elif kind == DROP:
                if payload == "window":  # what is still to run of work already there
                    for wid in pending:
                        res.carried_in_gpu_s += items[wid].geq * items[wid].duration
                    for q in queues.values():
                        res.carried_in_gpu_s += sum(x.geq * x.duration for x in q)
                    for wid in running:
                        it = items[wid]
                        res.carried_in_gpu_s += it.geq * max(0.0, started[it.idx] + it.duration - t)
                elif payload in pending:
                    assert isinstance(payload, str)
                    del pending[payload]
                    res.dropped_inference += items[payload].at >= w0
            elif kind == PLAN:
                if policy == "dynamic":
                    _plan(t)
                whole_dirty = True
                push(t + p.plan_every_s, PLAN, None)
        if whole_dirty and pending:
            result = sched.cycle(t, list(pending.values()), list(running.values()))
            snap.commit()
            for adm in result.admissions:
                w = pending.pop(adm.workload)
                w.alloc_ids = tuple(b.alloc_id for b in adm.bindings)
                w.started_at = t
                running[adm.workload] = w
                it = items[adm.workload]
                started[it.idx] = t
                served(it, t)
                push(t + it.duration, FINISH_WHOLE, adm.workload)
        whole_dirty = False
        if policy == "dynamic":
            m = mig_count()
            res.mig_gpus_min, res.mig_gpus_max = min(res.mig_gpus_min, m), max(res.mig_gpus_max, m)
    # Queued MIG inference that waited past its patience when the replay ends: dropped too.
    for q in queues.values():
        res.dropped_inference += sum(1 for it in q if it.at >= w0 and w1 - it.at > p.patience_s)
    res.training_backlog_gpus_at_end = sum(
        items[w].gpus for w in pending if items[w].kind == "training"
    )
    res.seconds = time.perf_counter() - wall
    return res


__all__ = ["POLICIES", "Params", "Trace", "build_trace", "replay"]
