"""Replay of the Microsoft Philly jobs through the queueing core (app/placement/queueing/).

Each job becomes a workload of its `cluster` (the tenant): `num_gpus` whole GPUs, one 8-GPU
node when it fits in one, otherwise a gang of 8-GPU (or 4-GPU) replicas that prefers one rack.
The trace has no priorities, declared runtimes or checkpoints, so the replay derives them,
deterministically per job (the same for every policy):

- priority class: production 5%, training 50%, research 30%, preemptible 15%;
- declared maximum runtime: the real duration plus 25%, rounded up to a minute (users declare
  limits above what they need; the scheduler only ever sees the declared figure);
- checkpoints every 10-60 minutes of run time, costing 30-300 s to write.

The fleet is 8-GPU nodes in racks of 8; tenants get guarantees in proportion to their share of
the trace's GPU time (90% of the fleet in all) and weights in the same proportion.

Events are arrivals, completions, and the end of a victim's grace period; a scheduling cycle
runs whenever anything changed, over the same snapshot, for every policy.
"""

from __future__ import annotations

import csv
import hashlib
import heapq
import math
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from app.placement.isolation import Tier
from app.placement.model import Level, Request, Shape, Topology
from app.placement.queueing import (
    BASELINES,
    Admission,
    Eviction,
    QueueConfig,
    Scheduler,
    TenantQuota,
    Workload,
    water_fill,
)
from app.placement.snapshot import NodeSpec, Snapshot

MODEL = "A100-80GB"
GPUS_PER_NODE = 8
NODES_PER_RACK = 8
BIG_GANG = 32


@dataclass
class Job:
    idx: int
    submit: float  # seconds from the first arrival (after --scale)
    duration: float
    gpus: int
    tenant: str
    priority: str
    max_runtime: float
    checkpoint_every: float
    checkpoint_cost: float
    done: float = 0.0  # work saved (seconds of run time)
    started: float | None = None
    finish: float | None = None
    preemptions: int = 0
    lost_gpu_s: float = 0.0
    version: int = 0  # invalidates scheduled completions after an eviction
    queued: float = 0.0  # seconds spent waiting: before the first start and after evictions
    waiting_since: float | None = None
    workload: Workload | None = None


def draw(idx: int, salt: str) -> float:
    """A number in [0, 1) fixed by the job's index and `salt`: the same draw on every run."""
    d = hashlib.blake2b(f"{salt}:{idx}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "big") / 2**64


def _priority(idx: int) -> str:
    x = draw(idx, "priority")
    if x < 0.05:
        return "production"
    if x < 0.55:
        return "training"
    if x < 0.85:
        return "research"
    return "preemptible"


def parse_window(text: str | None) -> tuple[float, float] | None:
    """`START:END` in days from the trace's first arrival, e.g. `14:42`."""
    if not text:
        return None
    lo, _, hi = text.partition(":")
    return float(lo or 0) * 86400, (float(hi) * 86400 if hi else math.inf)


def load_jobs(
    path: Path, window: tuple[float, float] | None = None, scale: float = 1.0
) -> list[Job]:
    """Jobs in arrival order. `window` (seconds from the first arrival) keeps a slice; `scale`
    divides arrival times (compressing time: scale 2 offers the same jobs twice as fast)."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append(
                (
                    datetime.fromisoformat(r["timestamp"]).timestamp(),
                    float(r["duration"]),
                    int(r["num_gpus"]),
                    r["cluster"],
                )
            )
    rows.sort()
    t0 = rows[0][0]
    jobs: list[Job] = []
    for i, (ts, dur, gpus, tenant) in enumerate(rows):
        at = ts - t0
        if window and not window[0] <= at < window[1]:
            continue
        dur = max(dur, 1.0)
        jobs.append(
            Job(
                idx=i,
                submit=at,
                duration=dur,
                gpus=gpus,
                tenant=tenant,
                priority=_priority(i),
                max_runtime=math.ceil(dur * 1.25 / 60) * 60,
                checkpoint_every=600 + 3000 * draw(i, "every"),
                checkpoint_cost=30 + 270 * draw(i, "cost"),
            )
        )
    if jobs:
        base = jobs[0].submit
        for j in jobs:
            j.submit = (j.submit - base) / scale
    return jobs


def request_of(job: Job) -> Request:
    if job.gpus <= GPUS_PER_NODE:
        return Request(f"j{job.idx}", job.tenant, Tier.DEDICATED, Shape(gpus=job.gpus))
    per = GPUS_PER_NODE if job.gpus % GPUS_PER_NODE == 0 else 4
    return Request(
        f"j{job.idx}",
        job.tenant,
        Tier.DEDICATED,
        Shape(gpus=per),
        replicas=job.gpus // per,
        topology=Topology(Level.RACK, required=False),
    )


def fleet(nodes: int, stacks: int = 1) -> list[NodeSpec]:
    """`nodes` 8-GPU nodes in racks of NODES_PER_RACK; with `stacks` > 1, racks take turns at
    running each of that many software stacks (an operator's stack moves a rack at a time)."""
    return [
        NodeSpec(
            f"n{i:04d}",
            MODEL,
            GPUS_PER_NODE,
            96_000,
            1_048_576,
            region="philly",
            rack=f"r{i // NODES_PER_RACK:03d}",
            block="b0",
            stack=f"s{(i // NODES_PER_RACK) % stacks}" if stacks > 1 else None,
        )
        for i in range(nodes)
    ]


def quotas(jobs: list[Job], gpus: int, guaranteed_share: float = 0.9) -> dict[str, TenantQuota]:
    """Guarantees and weights in proportion to each tenant's GPU time in the replayed jobs."""
    demand: dict[str, float] = {}
    for j in jobs:
        demand[j.tenant] = demand.get(j.tenant, 0.0) + j.duration * j.gpus
    total = sum(demand.values()) or 1.0
    return {
        t: TenantQuota(
            guaranteed={MODEL: int(gpus * 1000 * guaranteed_share * d / total)},
            weight=max(d / total, 1e-3),
        )
        for t, d in demand.items()
    }


@dataclass
class Result:
    policy: str
    jobs: int
    finished: int
    gpus: int
    share_cap: float | None  # the configuration's fair-share ceiling (None: work-conserving)
    priority_across_tenants: bool
    jct: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    big_gang_wait_ratio: float = 0.0
    big_gangs: int = 0
    busy_gpu_s: float = 0.0
    horizon_s: float = 0.0
    preemptions: int = 0
    lost_gpu_s: float = 0.0
    by_reason: dict[str, list[float]] = field(default_factory=dict)  # [evictions, GPU-s lost]
    shares: dict[str, dict[str, float]] = field(default_factory=dict)
    cycles: int = 0
    seconds: float = 0.0
    idle_backlogged_gpu_s: float = 0.0  # GPUs idle while some work waited
    backlogged_s: float = 0.0

    def as_dict(self) -> dict:
        def pct(xs: list[float], q: float) -> float:
            if not xs:
                return 0.0
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        # Tenants backlogged for at least 5% of the replay (shorter spells are noise).
        floor = 0.05 * self.horizon_s / 3600
        tracked = {t: v for t, v in self.shares.items() if v["backlogged_hours"] >= floor}
        worst = max((abs(v["ratio"] - 1) for v in tracked.values()), default=0.0)
        return {
            "policy": self.policy,
            "share_cap": self.share_cap,
            "priority_across_tenants": self.priority_across_tenants,
            "jobs": self.jobs,
            "finished": self.finished,
            "gpus": self.gpus,
            "mean_jct_s": round(statistics.fmean(self.jct), 1) if self.jct else 0.0,
            "p50_jct_s": round(pct(self.jct, 0.5), 1),
            "p95_jct_s": round(pct(self.jct, 0.95), 1),
            "p99_jct_s": round(pct(self.jct, 0.99), 1),
            "mean_queue_s": round(statistics.fmean(self.waits), 1) if self.waits else 0.0,
            "p99_queue_s": round(pct(self.waits, 0.99), 1),
            "big_gangs": self.big_gangs,
            "max_big_gang_wait_over_runtime": round(self.big_gang_wait_ratio, 3),
            "utilisation": round(self.busy_gpu_s / (self.gpus * self.horizon_s), 4)
            if self.horizon_s
            else 0.0,
            "idle_gpus_while_backlogged": round(self.idle_backlogged_gpu_s / self.backlogged_s, 1)
            if self.backlogged_s
            else 0.0,
            "preemptions": self.preemptions,
            "gpu_hours_lost_to_preemption": round(self.lost_gpu_s / 3600, 1),
            "preemptions_by_reason": {
                r: {"evictions": int(n), "gpu_hours_lost": round(s / 3600, 1)}
                for r, (n, s) in sorted(self.by_reason.items())
            },
            # Busy GPU time less the work that evictions threw away.
            "useful_utilisation": round(
                (self.busy_gpu_s - self.lost_gpu_s) / (self.gpus * self.horizon_s), 4
            )
            if self.horizon_s
            else 0.0,
            "tenant_share_vs_entitlement": {t: v["ratio"] for t, v in sorted(tracked.items())},
            "max_share_deviation": round(worst, 4),
            "cycles": self.cycles,
            "seconds": round(self.seconds, 1),
        }


# Event kinds, in their order at one instant: stops, starts, finishes, arrivals.
STOP, START, FINISH, ARRIVE = range(4)


@dataclass(eq=False)
class _Replay:
    """What the replay's loop carries: the jobs and their workloads, the events, the GPUs busy,
    the tenants' use and demand for the share accounting, and the result being filled."""

    jobs: list[Job]
    snap: Snapshot
    sched: Scheduler
    res: Result
    gpus: int
    horizon_end: float  # the last arrival: utilisation and shares are measured up to it
    weights: dict[str, float]
    by_id: dict[str, Job] = field(init=False)
    events: list[tuple[float, int, int, str, int]] = field(default_factory=list)
    seq: int = 0
    pending: dict[str, Workload] = field(default_factory=dict)
    running: dict[str, Workload] = field(default_factory=dict)
    starting: dict[str, float] = field(default_factory=dict)  # admitted after a grace period
    busy: int = 0  # GPUs busy (including victims in their grace period)
    last_t: float = 0.0
    share_used: dict[str, float] = field(default_factory=dict)
    share_ent: dict[str, float] = field(default_factory=dict)
    share_time: dict[str, float] = field(default_factory=dict)
    use: dict[str, float] = field(default_factory=dict)  # GPUs held per tenant (admitted work)
    want: dict[str, float] = field(default_factory=dict)  # GPUs asked for per tenant (pending)

    def __post_init__(self) -> None:
        self.by_id = {f"j{j.idx}": j for j in self.jobs}

    def push(self, t: float, kind: int, jid: str, version: int = 0) -> None:
        """Schedule an event; at one instant, by kind, then in the order pushed."""
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, jid, version))

    def move(self, tenant: str, held: float, asked: float) -> None:
        """A tenant's GPUs held and asked for change by these amounts."""
        self.use[tenant] = self.use.get(tenant, 0.0) + held
        self.want[tenant] = self.want.get(tenant, 0.0) + asked

    def account(self, t: float) -> None:
        """Busy GPU time, idle GPUs while work waits, and the backlogged tenants' share against
        their entitlement, from the last instant to `t`."""
        res, use, want = self.res, self.use, self.want
        dt = min(t, self.horizon_end) - self.last_t
        if dt > 0:
            res.busy_gpu_s += self.busy * dt
            # Share versus entitlement of the tenants with work waiting.
            backlogged = {t_ for t_, v in want.items() if v > 0}
            if backlogged:
                res.idle_backlogged_gpu_s += (self.gpus - self.busy) * dt
                res.backlogged_s += dt
                free = self.gpus - sum(u for t_, u in use.items() if t_ not in backlogged)
                demand = {t_: use.get(t_, 0.0) + want[t_] for t_ in backlogged}
                weights = self.weights
                ent = water_fill(free, demand, {t_: weights.get(t_, 1e-3) for t_ in backlogged})
                share_used, share_ent, share_time = self.share_used, self.share_ent, self.share_time
                for t_ in backlogged:
                    share_used[t_] = share_used.get(t_, 0.0) + use.get(t_, 0.0) * dt
                    share_ent[t_] = share_ent.get(t_, 0.0) + ent[t_] * dt
                    share_time[t_] = share_time.get(t_, 0.0) + dt
        self.last_t = max(self.last_t, min(t, self.horizon_end))

    def begin(self, j: Job, w: Workload, t: float) -> None:
        """The job runs from `t`: its wait ends and its completion is scheduled."""
        j.started = t
        assert j.waiting_since is not None
        j.queued += t - j.waiting_since
        j.waiting_since = None
        w.started_at = t
        self.busy += j.gpus
        j.version += 1
        self.push(t + (j.duration - j.done), FINISH, w.id, j.version)

    # --- the events, one handler per kind; each says whether a cycle is due ----------------

    def on_stop(self, t: float, j: Job, jid: str, version: int) -> bool:
        """A victim's grace period is over: its GPUs are free and it waits again."""
        self.busy -= j.gpus
        self.pending[jid] = j.workload  # type: ignore[assignment]
        j.waiting_since = t
        self.move(j.tenant, 0, j.gpus)
        return True

    def on_start(self, t: float, j: Job, jid: str, version: int) -> bool:
        """Work admitted after a grace period starts now."""
        if jid in self.starting:
            del self.starting[jid]
            self.begin(j, self.running[jid], t)
        return False

    def on_finish(self, t: float, j: Job, jid: str, version: int) -> bool:
        """The job's run ends (unless an eviction has made this completion stale)."""
        if version != j.version or jid not in self.running:
            return False
        w = self.running.pop(jid)
        for aid in w.alloc_ids:
            self.snap.release(aid)
        self.busy -= j.gpus
        self.move(j.tenant, -j.gpus, 0)
        j.finish = t
        self.res.finished += 1
        self.res.jct.append(t - j.submit)
        self.res.waits.append(j.queued)
        return True

    def on_arrive(self, t: float, j: Job, jid: str, version: int) -> bool:
        """The job is submitted as a workload and waits."""
        j.workload = Workload(
            jid,
            request_of(j),
            j.priority,
            j.submit,
            j.max_runtime,
            checkpoint_cost=j.checkpoint_cost,
            checkpoint_every=j.checkpoint_every,
        )
        self.pending[jid] = j.workload
        j.waiting_since = t
        self.move(j.tenant, 0, j.gpus)
        return True

    # --- the cycle ------------------------------------------------------------------------------

    def evict(self, t: float, ev: Eviction) -> None:
        """An eviction: the work since the last checkpoint is lost; it stops at the deadline."""
        res = self.res
        j = self.by_id[ev.workload]
        w = self.running.pop(ev.workload)
        self.move(j.tenant, -j.gpus, 0)
        assert j.started is not None
        if ev.lost_gpu_seconds == 0:  # checkpointed during the grace period
            saved_at = t
        else:
            saved_at = w.last_checkpoint(t)
        j.done += saved_at - j.started
        j.lost_gpu_s += (ev.deadline - saved_at) * j.gpus
        res.lost_gpu_s += (ev.deadline - saved_at) * j.gpus
        tally = res.by_reason.setdefault(ev.reason, [0, 0.0])
        tally[0] += 1
        tally[1] += (ev.deadline - saved_at) * j.gpus
        res.preemptions += 1
        j.preemptions += 1
        j.version += 1  # its completion no longer holds
        j.started = None
        w.started_at = None
        w.alloc_ids = ()
        w.preempted_at = t
        w.last_checkpoint_at = None
        self.push(ev.deadline, STOP, ev.workload)

    def admit(self, t: float, adm: Admission) -> None:
        """An admission holds its GPUs from now and runs now, or after its victims' grace."""
        j = self.by_id[adm.workload]
        w = self.pending.pop(adm.workload)
        self.move(j.tenant, j.gpus, -j.gpus)
        w.alloc_ids = tuple(b.alloc_id for b in adm.bindings)
        self.running[adm.workload] = w
        if adm.start_at > t:
            self.starting[adm.workload] = adm.start_at
            w.started_at = adm.start_at  # holds its GPUs from now, runs from then
            self.push(adm.start_at, START, adm.workload)
        else:
            self.begin(j, w, t)

    def cycle(self, t: float) -> None:
        """One queueing cycle over the waiting work: its evictions, then its admissions."""
        result = self.sched.cycle(t, list(self.pending.values()), list(self.running.values()))
        self.snap.commit()
        self.res.cycles += 1
        for ev in result.evictions:
            self.evict(t, ev)
        for adm in result.admissions:
            self.admit(t, adm)

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> float:
        """Every instant: the time since the last, its events, then a cycle if anything
        changed and work waits. Returns the last instant."""
        # Indexed by event kind (STOP, START, FINISH, ARRIVE).
        handlers = (self.on_stop, self.on_start, self.on_finish, self.on_arrive)
        events, by_id = self.events, self.by_id
        t = 0.0
        while events:
            t = events[0][0]
            changed = False
            self.account(t)
            while events and events[0][0] == t:
                _, kind, _, jid, version = heapq.heappop(events)
                changed |= handlers[kind](t, by_id[jid], jid, version)
            if not changed or not self.pending:
                continue
            self.cycle(t)
        return t

    def close(self, t: float) -> None:
        """The figures at the end (`t`, the last instant): big gangs' waits, tenants' shares."""
        res = self.res
        res.horizon_s = self.horizon_end
        # Gangs of 32+ GPUs: all the time they waited (also after evictions, and any still
        # waiting when the replay ends) over their runtime.
        for j in self.jobs:
            if j.gpus >= BIG_GANG:
                res.big_gangs += 1
                waited = j.queued + (t - j.waiting_since if j.waiting_since is not None else 0.0)
                res.big_gang_wait_ratio = max(res.big_gang_wait_ratio, waited / j.duration)
        share_used, share_ent = self.share_used, self.share_ent
        res.shares = {
            t_: {
                "ratio": round(share_used[t_] / share_ent[t_], 4) if share_ent[t_] else 1.0,
                "backlogged_hours": self.share_time[t_] / 3600,
            }
            for t_ in share_used
        }


def replay(
    jobs: list[Job],
    nodes: int,
    policy: str,
    tenants: dict[str, TenantQuota],
    config: QueueConfig | None = None,
    stacks: int = 1,
) -> Result:
    """Replay `jobs` on `nodes` 8-GPU nodes under the named queueing policy (its configuration
    from `BASELINES`, or `config` when given)."""
    start_wall = time.perf_counter()
    jobs = [
        Job(**{k: v for k, v in vars(j).items() if k != "workload"}) for j in jobs
    ]  # fresh state per policy
    if config is None:
        config = BASELINES[policy]
    snap = Snapshot(fleet(nodes, stacks))
    sched = Scheduler(snap, tenants, config)
    gpus = nodes * GPUS_PER_NODE
    res = Result(policy, len(jobs), 0, gpus, config.share_cap, config.priority_across_tenants)
    horizon_end = max((j.submit for j in jobs), default=0.0)
    weights = {t: q.weight for t, q in tenants.items()}
    r = _Replay(jobs, snap, sched, res, gpus, horizon_end, weights)
    for j in jobs:
        r.push(j.submit, ARRIVE, f"j{j.idx}")
    r.close(r.run())
    res.seconds = time.perf_counter() - start_wall
    return res
