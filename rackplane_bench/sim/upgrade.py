"""A rolling software-stack upgrade of a fleet under the Philly load: what the batch size costs
against the time the upgrade takes to finish.

It drives the same code as the service, never a copy: the queueing core
(`app/placement/queueing/`) places the Philly jobs (the same jobs, priorities and tenants as
`rackplane sim philly`), decides preemptions, and sees the upgrade only as the service's
scheduler would: cordoned nodes (`Snapshot.set_schedulable`), workloads requeued (expedited),
nodes back in service. Whether a workload can move now is the core's own what-if.

The rollout follows the service's rolling-upgrade semantics (app/fleet/upgrades.py, modelled
here, not imported):

- the scope's nodes, ordered by rack then name, fall into units: a node, or every node of one
  NVLink domain; `batch` units are upgraded at once (a count, or a share of the units, at
  least 1);
- a unit starts only while the scope's GPUs out of service (units in flight, failed units in
  repair) stay within `max_unavailable` of the scope's GPUs, or when nothing else is out;
- a started unit is cordoned. Work that checkpoints moves at its next checkpoint when the core
  can place it elsewhere now (it loses nothing; requeued expedited, resumes from the
  checkpoint). At a node's drain deadline (the largest checkpoint interval of the checkpointing
  work on it, at most `drain_wait`; 0 when none of its work checkpoints) what remains gets the
  preemption grace and is requeued: it loses the work since its last checkpoint (since its start
  when it never checkpoints);
- once empty, the unit applies the stack (`apply_s`), runs the burn-in (`burn_in_s`) and
  returns to service; with probability `fail_rate` it fails instead, goes to repair for
  `repair_s` and then returns (the rollout does not pause for failures here);
- the next units start as units finish.

Which Philly jobs checkpoint is an assumption (the trace says nothing): jobs that run longer
than `checkpoint_above_s` checkpoint every `checkpoint_every_s` (a hash of the job's index picks
`checkpoint_share` of them); shorter ones never do. The same jobs go to the no-upgrade
baseline, which is then `philly.replay` of those jobs, event for event (a test holds it).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

from app.placement.queueing import BASELINES, QueueConfig, Scheduler, TenantQuota, Workload
from app.placement.snapshot import NodeSpec, Snapshot
from rackplane_bench.sim import philly

DAY = 86400.0
GPUS_PER_NODE = philly.GPUS_PER_NODE


@dataclass(frozen=True)
class Params:
    batch: str = "1"  # units at once: a count, or N% of the units (at least 1)
    max_unavailable: str = "100%"  # of the scope's GPUs out of service at once
    start_s: float = 2 * DAY  # upgrade start, seconds after the replay's first arrival
    drain_wait_s: float = 1800.0  # cap of a node's drain deadline
    grace_s: float = 30.0  # preemption grace when a node drains
    apply_s: float = 900.0  # driver install and reboot
    burn_in_s: float = 2400.0  # dcgmi diag -r 3 and an NCCL all-reduce
    fail_rate: float = 0.0  # a unit's chance that apply or burn-in fails
    repair_s: float = 4 * 3600.0  # a failed unit is back after this long
    seed: int = 1  # which units fail


@dataclass(frozen=True)
class Checkpoints:
    """Which Philly jobs checkpoint, and how often (the trace has no such field)."""

    above_s: float = 3600.0  # jobs running longer than this checkpoint ...
    every_s: float = 1800.0  # ... this often
    share: float = 1.0  # ... this share of them (by a hash of the job's index)


def with_checkpoints(jobs: list[philly.Job], c: Checkpoints = Checkpoints()) -> list[philly.Job]:
    """The jobs with the upgrade's checkpoint assumption (write costs stay Philly's 30-300 s)."""
    out = []
    for j in jobs:
        ckpt = j.duration > c.above_s and philly.draw(j.idx, "upgrade-checkpoint") < c.share
        out.append(replace(j, checkpoint_every=c.every_s if ckpt else 0.0, workload=None))
    return out


def parse_count(text: str, total: int) -> int:
    """`N` or `N%` of `total`, at least 1 (a share rounds down, as Kubernetes' maxUnavailable)."""
    text = text.strip()
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0 < pct <= 100:
            raise ValueError(f"{text!r}: a share is above 0% and at most 100%")
        return max(1, math.floor(pct / 100 * total + 1e-9))
    n = int(text)
    if n < 1:
        raise ValueError(f"{text!r}: at least 1")
    return n


def parse_share(text: str) -> float:
    text = text.strip()
    pct = float(text[:-1]) if text.endswith("%") else float(text) * 100
    if not 0 < pct <= 100:
        raise ValueError(f"{text!r}: above 0% and at most 100%")
    return pct / 100


def units_of(nodes: list[NodeSpec]) -> list[list[int]]:
    """The scope's upgrade units in order: nodes by rack then name; a node alone, or every node
    of its NVLink domain together (the domain where its first node falls)."""
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].rack or "", nodes[i].name))
    units: list[list[int]] = []
    by_domain: dict[str, list[int]] = {}
    for i in order:
        d = nodes[i].domain
        if d is None:
            units.append([i])
        elif d in by_domain:
            by_domain[d].append(i)
        else:
            by_domain[d] = [i]
            units.append(by_domain[d])
    return units


# Event kinds: at one instant, stops, starts, finishes and arrivals first (as philly.replay),
# then the upgrade's own.
STOP, START, FINISH, ARRIVE, CHECKPOINT, DEADLINE, APPLIED, BACK, LAUNCH = range(9)


@dataclass(eq=False)
class Unit:
    idx: int
    nodes: list[int]
    gpus: int
    state: str = "waiting"  # waiting | draining | applying | repair | done
    cordoned_at: float | None = None
    empty_at: float | None = None  # work gone: apply begins
    back_at: float | None = None
    failed: bool = False
    clear_at: float = 0.0  # the last stopping victim's GPUs are free then


@dataclass
class Result:
    batch: str | None  # None: the no-upgrade baseline
    nodes: int
    gpus: int
    units: int = 0
    units_at_once: int = 0
    limit_gpus: int = 0
    start_s: float = 0.0
    finish_s: float | None = None
    out_gpu_s: float = 0.0
    moved_at_checkpoint: int = 0
    drained: int = 0
    starts_cancelled: int = 0
    lost_gpu_s: float = 0.0  # the upgrade's
    failures: int = 0
    preemptions: int = 0  # the queueing core's own
    jobs: int = 0
    finished: int = 0
    cycles: int = 0
    seconds: float = 0.0
    # (t, GPUs busy) after each change; (t, GPUs out, units in flight) after each change.
    busy: list[tuple[float, int]] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    queued: dict[int, float] = field(default_factory=dict)  # job index -> seconds waited
    submit: dict[int, float] = field(default_factory=dict)
    moves: list[dict[str, Any]] = field(default_factory=list)  # every workload the upgrade moved
    unit_log: list[Unit] = field(default_factory=list)

    def busy_gpu_s(self, lo: float, hi: float) -> float:
        """Busy GPU-seconds in [lo, hi]."""
        total = 0.0
        pts = self.busy
        for k, (t, b) in enumerate(pts):
            end = pts[k + 1][0] if k + 1 < len(pts) else math.inf
            a, z = max(t, lo), min(end, hi)
            if z > a:
                total += b * (z - a)
        return total

    def utilisation(self, lo: float, hi: float) -> float:
        return self.busy_gpu_s(lo, hi) / (self.gpus * (hi - lo)) if hi > lo else 0.0

    def mean_wait(self, lo: float, hi: float) -> float:
        """Mean queueing of the jobs submitted in [lo, hi] (all of their waits)."""
        w = [q for i, q in self.queued.items() if lo <= self.submit[i] <= hi]
        return statistics.fmean(w) if w else 0.0


class _Replay:
    def __init__(
        self,
        jobs: list[philly.Job],
        nodes: int,
        tenants: dict[str, TenantQuota],
        p: Params | None,
        config: QueueConfig,
        fleet: list[NodeSpec] | None = None,
    ):
        self.p = p
        # Fresh state per replay (as philly.replay).
        self.jobs = [
            philly.Job(**{k: v for k, v in vars(j).items() if k != "workload"}) for j in jobs
        ]
        self.specs = fleet or philly.fleet(nodes)
        self.snap = Snapshot(self.specs)
        self.sched = Scheduler(self.snap, tenants, config)
        self.gpus = sum(s.gpus for s in self.specs)
        self.res = Result(p.batch if p else None, len(self.specs), self.gpus, jobs=len(jobs))
        self.by_id = {f"j{j.idx}": j for j in self.jobs}
        self.events: list[tuple[float, int, int, Any, int]] = []
        self.seq = 0
        self.pending: dict[str, Workload] = {}
        self.running: dict[str, Workload] = {}
        self.starting: dict[str, float] = {}
        self.busy = 0
        self.on_node: dict[int, set[str]] = {}  # node -> workloads holding GPUs there
        self.nodes_of: dict[str, list[int]] = {}
        self.units: list[Unit] = []
        self.draining: set[Unit] = set()
        self.unit_of: dict[int, Unit] = {}
        self.deadline: dict[int, float] = {}  # cordoned node -> its drain deadline
        self.next_unit = 0
        self.in_flight = 0
        self.out_gpus = 0
        self.k = 0
        self.limit = 0
        if p is not None:
            for i, u in enumerate(units_of(self.specs)):
                unit = Unit(i, u, sum(self.specs[n].gpus for n in u))
                self.units.append(unit)
                for n in u:
                    self.unit_of[n] = unit
            self.res.units = len(self.units)
            batch = parse_count(p.batch, len(self.units))
            self.limit = math.floor(parse_share(p.max_unavailable) * self.gpus + 1e-9)
            biggest = max(u.gpus for u in self.units)
            self.k = max(1, min(batch, self.limit // biggest))
            self.res.units_at_once, self.res.limit_gpus = self.k, self.limit
            self.res.start_s = p.start_s
            self.res.unit_log = self.units

    def push(self, t: float, kind: int, jid: Any = "", version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, jid, version))

    # --- the replay ---------------------------------------------------------------------------

    def run(self) -> Result:
        wall = time.perf_counter()
        for j in self.jobs:
            self.push(j.submit, ARRIVE, f"j{j.idx}")
            self.res.submit[j.idx] = j.submit
        if self.p is not None:
            self.push(self.p.start_s, LAUNCH)
        self.res.busy.append((0.0, 0))
        while self.events:
            t = self.events[0][0]
            changed = False
            while self.events and self.events[0][0] == t:
                _, kind, _, jid, version = heapq.heappop(self.events)
                changed |= self._handle(t, kind, jid, version)
            if self.p is not None:
                self._check_empty(t)
            self._mark(t)
            if not changed or not self.pending:
                continue
            self._cycle(t)
            self._mark(t)
        for j in self.jobs:
            self.res.queued[j.idx] = j.queued
        self.res.seconds = time.perf_counter() - wall
        return self.res

    def _mark(self, t: float) -> None:
        if self.res.busy[-1][1] != self.busy:
            if self.res.busy[-1][0] == t:
                self.res.busy[-1] = (t, self.busy)
            else:
                self.res.busy.append((t, self.busy))

    def _handle(self, t: float, kind: int, jid: Any, version: int) -> bool:
        if kind >= CHECKPOINT:
            return self._upgrade_event(t, kind, jid, version)
        j = self.by_id[jid]
        if kind == ARRIVE:
            j.workload = Workload(
                jid,
                philly.request_of(j),
                j.priority,
                j.submit,
                j.max_runtime,
                checkpoint_cost=j.checkpoint_cost,
                checkpoint_every=j.checkpoint_every,
            )
            self.pending[jid] = j.workload
            j.waiting_since = t
            return True
        if kind == FINISH and version == j.version and jid in self.running:
            self._release(jid)
            self.busy -= j.gpus
            j.finish = t
            self.res.finished += 1
            return True
        if kind == STOP:
            self.busy -= j.gpus
            self.pending[jid] = j.workload  # type: ignore[assignment]
            j.waiting_since = t
            return True
        if kind == START and self.starting.get(jid) == t:
            del self.starting[jid]
            self._begin(j, self.running[jid], t)
        return False

    def _begin(self, j: philly.Job, w: Workload, t: float) -> None:
        j.started = t
        assert j.waiting_since is not None
        j.queued += t - j.waiting_since
        j.waiting_since = None
        w.started_at = t
        self.busy += j.gpus
        j.version += 1
        self.push(t + (j.duration - j.done), FINISH, w.id, j.version)

    def _release(self, jid: str) -> list[int]:
        """The workload leaves the fleet (finished, evicted or moved): its allocations go."""
        w = self.running.pop(jid)
        for aid in w.alloc_ids:
            self.snap.release(aid)
        nodes = self.nodes_of.pop(jid, [])
        for n in nodes:
            s = self.on_node.get(n)
            if s is not None:
                s.discard(jid)
        return nodes

    def _cycle(self, t: float) -> None:
        result = self.sched.cycle(t, list(self.pending.values()), list(self.running.values()))
        self.snap.commit()
        self.res.cycles += 1
        for ev in result.evictions:
            j = self.by_id[ev.workload]
            w = self.running[ev.workload]
            nodes = self.nodes_of.get(ev.workload, [])
            self.running.pop(ev.workload)  # the core released its allocations
            self.nodes_of.pop(ev.workload, None)
            for n in nodes:
                self.on_node.get(n, set()).discard(ev.workload)
                u = self.unit_of.get(n)
                if u is not None and u.state == "draining":
                    u.clear_at = max(u.clear_at, ev.deadline)
            assert j.started is not None
            saved_at = t if ev.lost_gpu_seconds == 0 else w.last_checkpoint(t)
            j.done += saved_at - j.started
            self.res.preemptions += 1
            j.version += 1
            j.started = None
            w.started_at, w.alloc_ids, w.preempted_at, w.last_checkpoint_at = None, (), t, None
            self.push(ev.deadline, STOP, ev.workload)
        for adm in result.admissions:
            j = self.by_id[adm.workload]
            w = self.pending.pop(adm.workload)
            w.alloc_ids = tuple(b.alloc_id for b in adm.bindings)
            w.expedited = False  # back in the fleet: ordinary again
            self.running[adm.workload] = w
            nodes = sorted({self.snap.node_index[b.node] for b in adm.bindings})
            self.nodes_of[adm.workload] = nodes
            for n in nodes:
                self.on_node.setdefault(n, set()).add(adm.workload)
            if adm.start_at > t:
                self.starting[adm.workload] = adm.start_at
                w.started_at = adm.start_at
                self.push(adm.start_at, START, adm.workload)
            else:
                self._begin(j, w, t)

    # --- the upgrade --------------------------------------------------------------------------

    def _upgrade_event(self, t: float, kind: int, data: Any, version: int) -> bool:
        assert self.p is not None
        if kind == LAUNCH:
            self._launch(t)
            return False
        if kind == CHECKPOINT:
            return self._checkpoint_move(t, str(data), version)
        if kind == DEADLINE:
            return self._drain_node(t, int(data))
        unit = self.units[int(data)]
        if kind == APPLIED:
            if unit.failed:
                unit.state = "repair"
                self.in_flight -= 1
                self.push(t + self.p.repair_s, BACK, unit.idx)
                self._record(t)
                self._launch(t)
                return False
            return self._back(t, unit)
        if kind == BACK:
            return self._back(t, unit)
        raise AssertionError(kind)

    def _record(self, t: float) -> None:
        self.res.timeline.append((t, self.out_gpus, self.in_flight))

    def _launch(self, t: float) -> None:
        """Start the next units while the batch and max-unavailable allow."""
        while self.next_unit < len(self.units) and self.in_flight < self.k:
            u = self.units[self.next_unit]
            if self.out_gpus and self.out_gpus + u.gpus > self.limit:
                break
            self.next_unit += 1
            self._cordon(t, u)

    def _cordon(self, t: float, u: Unit) -> None:
        assert self.p is not None
        u.state, u.cordoned_at = "draining", t
        self.draining.add(u)
        self.in_flight += 1
        self.out_gpus += u.gpus
        self._record(t)
        for n in u.nodes:
            self.snap.set_schedulable(self.specs[n].name, False)
        # Work admitted here but still waiting for its victims to stop: back to the queue.
        for n in u.nodes:
            for wid in sorted(self.on_node.get(n, ())):
                if wid in self.starting:
                    del self.starting[wid]
                    w = self.running[wid]
                    self._release(wid)
                    w.alloc_ids, w.started_at = (), None
                    w.expedited = True
                    self.pending[wid] = w
                    self.res.starts_cancelled += 1
        self.snap.commit()
        # Each node's drain deadline: the largest checkpoint interval of its checkpointing
        # work, at most drain_wait; at once when none of its work checkpoints.
        for n in u.nodes:
            every = [self.running[wid].checkpoint_every or 0.0 for wid in self.on_node.get(n, ())]
            self.deadline[n] = t + min(self.p.drain_wait_s, max(every, default=0.0))
            self.push(self.deadline[n], DEADLINE, n)
        # Checkpointing work tries to move at its next checkpoint before the deadline.
        seen: set[str] = set()
        for n in u.nodes:
            for wid in sorted(self.on_node.get(n, ())):
                if wid in seen:
                    continue
                seen.add(wid)
                w = self.running[wid]
                if not w.checkpoint_every or w.started_at is None:
                    continue
                nxt = self._next_checkpoint(w, t)
                due = min(self.deadline.get(m, math.inf) for m in self.nodes_of[wid])
                if nxt <= due:
                    self.push(nxt, CHECKPOINT, wid, self.by_id[wid].version)

    @staticmethod
    def _next_checkpoint(w: Workload, t: float) -> float:
        assert w.started_at is not None and w.checkpoint_every
        k = math.floor((t - w.started_at) / w.checkpoint_every) + 1
        return w.started_at + k * w.checkpoint_every

    def _checkpoint_move(self, t: float, wid: str, version: int) -> bool:
        j = self.by_id[wid]
        if wid not in self.running or j.version != version or wid in self.starting:
            return False  # finished, evicted or moved since
        w = self.running[wid]
        # Capacity elsewhere now, as the core sees it (cordoned nodes are closed to it).
        probe = Workload(
            wid,
            w.request,
            w.priority,
            w.submitted_at,
            w.max_runtime,
            w.checkpoint_cost,
            checkpoint_every=w.checkpoint_every,
            expedited=True,
        )
        others = [v for k, v in self.running.items() if k != wid]
        # Its own GPUs stay held (and cordoned): only capacity elsewhere counts.
        answer = self.sched.what_if(probe, t, [], others)
        if not answer.placeable_now or answer.preempts:
            return False
        self._stop(t, wid, saved=t, stop_at=t, how="checkpoint")
        return True

    def _drain_node(self, t: float, n: int) -> bool:
        assert self.p is not None
        changed = False
        for wid in sorted(self.on_node.get(n, ())):
            if wid not in self.running or wid in self.starting:
                continue
            w = self.running[wid]
            assert w.started_at is not None
            self._stop(t, wid, saved=w.last_checkpoint(t), stop_at=t + self.p.grace_s, how="drain")
            changed = True
        return changed

    def _stop(self, t: float, wid: str, saved: float, stop_at: float, how: str) -> None:
        """The upgrade moves the workload: saved work kept, the rest lost, requeued expedited
        at `stop_at` (its GPUs stay busy until then)."""
        j = self.by_id[wid]
        w = self.running[wid]
        assert j.started is not None and w.started_at is not None
        lost = (stop_at - saved) * j.gpus
        self.res.lost_gpu_s += lost
        self.res.moves.append(
            {
                "job": j.idx,
                "how": how,
                "at": t,
                "started": j.started,
                "saved": saved,
                "lost_gpu_s": lost,
                "checkpoint_every": w.checkpoint_every or 0.0,
                "done_before": j.done,
            }
        )
        if how == "checkpoint":
            self.res.moved_at_checkpoint += 1
        else:
            self.res.drained += 1
        j.done += saved - j.started
        nodes = self._release(wid)
        for m in nodes:
            u = self.unit_of.get(m)
            if u is not None and u.state == "draining":
                u.clear_at = max(u.clear_at, stop_at)
        j.version += 1
        j.started = None
        w.started_at, w.alloc_ids, w.preempted_at, w.last_checkpoint_at = None, (), t, None
        w.expedited = True
        self.push(stop_at, STOP, wid)

    def _check_empty(self, t: float) -> None:
        """Draining units with no work left begin their apply (once stopping work is off)."""
        assert self.p is not None
        for u in sorted(self.draining, key=lambda x: x.idx):
            if any(self.on_node.get(n) for n in u.nodes):
                continue
            self.draining.discard(u)
            u.state = "applying"
            u.empty_at = max(t, u.clear_at)
            rng = random.Random(f"{self.p.seed}:{u.idx}")
            u.failed = rng.random() < self.p.fail_rate
            self.push(u.empty_at + self.p.apply_s + self.p.burn_in_s, APPLIED, u.idx)

    def _back(self, t: float, u: Unit) -> bool:
        if u.state != "repair":
            self.in_flight -= 1
        else:
            self.res.failures += 1
        u.state, u.back_at = "done", t
        self.out_gpus -= u.gpus
        assert u.cordoned_at is not None
        self.res.out_gpu_s += u.gpus * (t - u.cordoned_at)
        for n in u.nodes:
            self.snap.set_schedulable(self.specs[n].name, True)
        self.snap.commit()
        self._record(t)
        self._launch(t)
        if all(x.state == "done" for x in self.units):
            self.res.finish_s = t
        return True


def replay(
    jobs: list[philly.Job],
    nodes: int,
    tenants: dict[str, TenantQuota],
    p: Params | None,
    policy: str = "default",
    fleet: list[NodeSpec] | None = None,
) -> Result:
    """Replay `jobs` on `nodes` 8-GPU nodes under `policy`, with the rolling upgrade `p` (None:
    no upgrade, the baseline)."""
    return _Replay(jobs, nodes, tenants, p, BASELINES[policy], fleet).run()


def summary(r: Result, base: Result) -> dict[str, Any]:
    """One batch size's figures against the baseline, over the upgrade's window."""
    lo = r.start_s
    hi = r.finish_s if r.finish_s is not None else lo
    util, b_util = r.utilisation(lo, hi), base.utilisation(lo, hi)
    wait, b_wait = r.mean_wait(lo, hi), base.mean_wait(lo, hi)
    last_arrival = max(r.submit.values(), default=0.0)
    return {
        "batch": r.batch,
        "units": r.units,
        "units_at_once": r.units_at_once,
        "hours_to_finish": round((hi - lo) / 3600, 2),
        "gpu_hours_out_of_service": round(r.out_gpu_s / 3600, 1),
        "work_moved": r.moved_at_checkpoint + r.drained,
        "moved_at_checkpoint": r.moved_at_checkpoint,
        "drained": r.drained,
        "starts_cancelled": r.starts_cancelled,
        "lost_work_gpu_hours": round(r.lost_gpu_s / 3600, 1),
        "utilisation": round(util, 4),
        "baseline_utilisation": round(b_util, 4),
        "utilisation_drop": round(b_util - util, 4),
        "mean_queue_wait_s": round(wait, 1),
        "baseline_mean_queue_wait_s": round(b_wait, 1),
        "failures": r.failures,
        "max_gpus_out": max((o for _, o, _ in r.timeline), default=0),
        "limit_gpus": r.limit_gpus,
        "load_covers_window": last_arrival >= hi,
        "preemptions": r.preemptions,
        "baseline_preemptions": base.preemptions,
        "jobs": r.jobs,
        "finished": r.finished,
        "seconds": round(r.seconds, 1),
    }
