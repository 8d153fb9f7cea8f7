"""Goodput under hardware faults: a large synchronous training job and a background mix on a
simulated fleet, with faults drawn at published rates, replayed under several recovery policies.

It drives the same code as the service, never a copy:
- the queueing core (`app/placement/queueing/`) places the job, its replacements, its hot
  spares and the background work (the Philly trace's jobs), with priorities and preemption;
- the health loop's action table (`app/health/actions.py`) says what each fault does: which
  hardware leaves service (the GPU, the node, the NVLink domain) and how it is repaired (reset,
  reboot, service), and its state table (`app/health/states.py`) checks every transition.

Faults are drawn once per run (seeded) and every policy sees the same ones:
- `manual`: no health loop. A failed job waits for a human (who also runs the repair) and
  restarts from its last checkpoint on whatever capacity there is;
- `requeue`: the health loop: faults detected from telemetry, hardware quarantined and
  repaired, the job requeued at once (expedited) from its last checkpoint; its replacement
  capacity comes from the spare pool, preempting background work there;
- `default`: the loop, plus warm hot spares held for the job (no wait for capacity, no
  provisioning), hangs found from step-time telemetry instead of the collective's timeout,
  proactive migration off GPUs that turned suspect (at the job's next checkpoint), and the
  checkpoint interval the loop advises from the fault rate it measures (Young/Daly).

Wall time of the job is split exactly into training progress, checkpoint writes, work lost
(recomputed), detection, waiting for capacity and restarts: the parts sum to the horizon.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.health import actions
from app.health.actions import Action, Repair, Rule, Scope
from app.health.states import Actor, Health, check
from app.placement.isolation import Tier
from app.placement.model import Request, Shape
from app.placement.queueing import BASELINES, Scheduler, TenantQuota, Workload
from app.placement.snapshot import FAILED, NodeSpec, Snapshot
from rackplane_bench.sim import philly

MODEL = "H100-80GB"
GPUS_PER_NODE = 8
NODES_PER_RACK = 16
POLICIES = ("manual", "requeue", "default")
DAY = 86400.0
IN_SERVICE = (Health.healthy, Health.suspect)
JOB = "llm"  # the big job's tenant and workload id


@dataclass(frozen=True)
class Cause:
    """One root cause of an unexpected interruption, as the health loop would see it."""

    name: str
    share: float  # weight among the causes
    rule: Rule | None  # the table's row it arrives as; None: no telemetry sees it
    detect: str  # telemetry | crash (the job exits) | hang (collectives stall) | heartbeat
    back: float  # share that comes back after the rule's repair; the rest go to service
    warned: float = 0.0  # share preceded by a watch-level signal (the GPU turns suspect)


def _xid(code: int) -> Rule:
    return actions.rule_for_xid(code)


# A rule for what DCGM does not see (a cable, a NIC, a switch): the operator takes the node out
# for service once the hang is localised. Its action comes from the same table of effects.
_HANG = Rule("collective_hang", None, Action.service, "collective hang localised to a node", "sim")

# Llama 3 405B's unexpected interruptions over 54 days on 16,384 H100 GPUs, by root cause
# ("The Llama 3 Herd of Models", Table 5), weighted by the table's counts (419 in all; its
# printed percentages do not all match them: faulty GPU 148 is printed as 30.1%). What each
# cause arrives as, how it is detected and the share that returns after the repair are our
# reading (BENCHMARKS.md §7).
LLAMA3: tuple[Cause, ...] = (
    Cause("faulty_gpu", 148, _xid(79), "telemetry", 0.5),
    Cause("gpu_hbm3", 72, actions.SIGNALS["ecc_dbe"], "telemetry", 0.8),
    Cause("software_bug", 54, _xid(13), "crash", 1.0),
    Cause("network_switch_cable", 35, _HANG, "hang", 0.0),
    Cause("host_maintenance", 32, actions.SIGNALS["heartbeat_lost"], "heartbeat", 0.5),
    Cause("gpu_sram", 19, _xid(95), "telemetry", 0.8),
    Cause("gpu_system_processor", 17, _xid(119), "telemetry", 0.9),
    Cause("nic", 7, _HANG, "hang", 0.0),
    Cause("nccl_watchdog", 7, None, "hang", 1.0),
    Cause("silent_data_corruption", 6, _HANG, "hang", 0.0),
    Cause("gpu_thermal", 6, actions.SIGNALS["heartbeat_lost"], "heartbeat", 0.0),
    Cause("host_hardware", 14, actions.SIGNALS["heartbeat_lost"], "heartbeat", 0.0),
    Cause("dependency", 2, _xid(13), "crash", 1.0),
)


@dataclass(frozen=True)
class Params:
    gpus: int = 16_384
    days: float = 54.0
    seed: int = 1
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs, per GPU.
    faults_per_gpu_day: float = 419 / (54 * 16_384)
    spare_share: float = 0.02  # of the fleet's nodes kept out of the job (background runs there)
    # Nodes of the spare pool held idle and warm for the job (default policy).
    hot_spares: int | None = None  # None: hot_spares_for() (ByteRobust's P99 rule, capped)
    checkpoint_every_s: float = 1800.0  # the job's own interval (manual, requeue)
    # The training loop's stall per checkpoint: an in-memory snapshot (ByteRobust, Table 8:
    # 0.2-1.8 s "memory save"; Megatron's synchronous save 7-13 s).
    checkpoint_cost_s: float = 2.0
    # Relaunch on the same and warm nodes (ByteRobust, Table 7: 65 s on 1,024 machines).
    restart_s: float = 65.0
    # A cold node joins (pods rescheduled, images pulled); warm standby is 5.36x faster than a
    # reschedule (ByteRobust): 65 x 5.36 - 65.
    provision_s: float = 285.0
    detect_s: float = 15.0  # a fault seen by telemetry (one report period)
    heartbeat_s: float = 90.0  # a silent node agent (RACKPLANE_HEARTBEAT_TIMEOUT)
    hang_timeout_s: float = 600.0  # the collective library's watchdog (PyTorch NCCL: 10 min)
    # default: no step reported for this long is a hang, localised by the loop's checks
    # (ByteRobust's real-time checks: 10-60 s).
    stall_detect_s: float = 60.0
    human_s: float = 1800.0  # manual: someone notices, triages and restarts
    reset_s: float = 5.0  # RACKPLANE_SIM_RESET_SECONDS
    reboot_s: float = 180.0  # RACKPLANE_SIM_REBOOT_SECONDS
    validate_s: float = 120.0
    service_h: float = 48.0  # out of service: parts replaced, back after this long
    warn_lead_h: float = 6.0  # a warned fault: the GPU turns suspect this long before
    background_load: float = 0.6  # background GPU demand / the spare pool's GPUs
    causes: tuple[Cause, ...] = LLAMA3


@dataclass
class Fault:
    at: float
    node: int
    gpu: int
    cause: Cause
    back: bool
    warned: bool
    avoided: bool = False  # the job moved off it before it struck, and the GPU was repaired


def draw_faults(p: Params) -> list[Fault]:
    """The run's faults: a Poisson process over the fleet's GPUs, causes by share."""
    rng = random.Random(p.seed)
    nodes = p.gpus // GPUS_PER_NODE
    rate = p.faults_per_gpu_day * nodes * GPUS_PER_NODE / DAY
    weights = [c.share for c in p.causes]
    out: list[Fault] = []
    t, horizon = 0.0, p.days * DAY
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            return out
        cause = rng.choices(p.causes, weights)[0]
        out.append(
            Fault(
                t,
                rng.randrange(nodes),
                rng.randrange(GPUS_PER_NODE),
                cause,
                rng.random() < cause.back,
                rng.random() < cause.warned,
            )
        )


def background_jobs(p: Params, trace: Path) -> list[philly.Job]:
    """Philly's jobs over the replay's days, thinned (deterministically) so their GPU demand is
    `background_load` of the spare pool, and no wider than a quarter of it."""
    spare_gpus = _spare_nodes(p) * GPUS_PER_NODE
    jobs = philly.load_jobs(trace, (0.0, p.days * DAY))
    if not jobs or not spare_gpus:
        return []
    span = max(j.submit for j in jobs) or 1.0
    fit = [j for j in jobs if j.gpus <= max(1, spare_gpus // 4)]
    load = sum(j.duration * j.gpus for j in fit) / span
    keep = min(1.0, p.background_load * spare_gpus / load) if load else 0.0
    return [j for j in fit if philly.draw(j.idx, "background") < keep]


def _spare_nodes(p: Params) -> int:
    return max(1, math.ceil(p.spare_share * (p.gpus // GPUS_PER_NODE)))


def hot_spares_for(p: Params) -> int:
    """Warm spares for the job: the 99th percentile of the job's node failures in a day (how
    ByteRobust sizes warm standby), at most a third of the spare pool (the rest runs background
    work, and the pool refills the spares by preempting it), at least one."""
    job_gpus = (p.gpus // GPUS_PER_NODE - _spare_nodes(p)) * GPUS_PER_NODE
    mean = p.faults_per_gpu_day * job_gpus
    k, term = 0, math.exp(-mean)
    total = term
    while total < 0.99:
        k += 1
        term *= mean / k
        total += term
    return max(1, min(k, _spare_nodes(p) // 3))


def young_daly(cost: float, mtbf: float) -> float:
    """Daly's (2006) optimum checkpoint interval, work between checkpoints, for checkpoint cost
    `cost` and mean time between failures `mtbf` (Young's sqrt(2 cost mtbf), refined)."""
    if cost >= 2 * mtbf:
        return mtbf
    x = math.sqrt(2 * cost * mtbf)
    return x * (1 + math.sqrt(cost / (2 * mtbf)) / 3 + cost / (18 * mtbf)) - cost


# --- the replay ---------------------------------------------------------------------------------

FAULT, WARN, MOVE, DETECTED, REPAIRED, STOP, START, UP, BG_ARRIVE, BG_FINISH = range(10)


@dataclass
class Result:
    policy: str
    gpus: int
    days: float
    job_gpus: int
    spare_nodes: int
    hot_spares: int
    progress_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # wall seconds of the job, by use
    interruptions: int = 0
    avoided: int = 0  # warned faults the job moved away from before they struck
    faults: int = 0
    mttr: list[float] = field(default_factory=list)
    checkpoint_interval_s: float = 0.0
    bg_jobs: int = 0
    bg_finished: int = 0
    bg_jct: list[float] = field(default_factory=list)
    bg_lost_gpu_s: float = 0.0
    transitions: int = 0
    cycles: int = 0
    seconds: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)  # what the replay was run with

    def as_dict(self) -> dict:
        horizon = self.days * DAY
        hours = self.job_gpus / 3600
        mttr = sorted(self.mttr)

        def q(x: float) -> float:
            return round(mttr[min(len(mttr) - 1, int(x * len(mttr)))], 1) if mttr else 0.0

        lost = {
            k: round(self.parts.get(k, 0.0) * hours, 1)
            for k in ("detection", "restart", "recomputation", "waiting_for_capacity")
        }
        return {
            "policy": self.policy,
            "gpus": self.gpus,
            "days": self.days,
            "job_gpus": self.job_gpus,
            "spare_nodes": self.spare_nodes,
            "hot_spares": self.hot_spares,
            "effective_training_time": round(self.progress_s / horizon, 4),
            "goodput_gpu_hours": round(self.progress_s * hours, 1),
            "lost_gpu_hours": lost,
            "checkpoint_gpu_hours": round(self.parts.get("checkpointing", 0.0) * hours, 1),
            "interruptions": self.interruptions,
            "avoided_by_migration": self.avoided,
            "fleet_faults": self.faults,
            "mttr_s": {"p50": q(0.5), "p99": q(0.99)},
            "checkpoint_interval_s": round(self.checkpoint_interval_s, 1),
            "background": {
                "jobs": self.bg_jobs,
                "finished": self.bg_finished,
                "mean_jct_s": round(statistics.fmean(self.bg_jct), 1) if self.bg_jct else 0.0,
                "lost_gpu_hours": round(self.bg_lost_gpu_s / 3600, 1),
            },
            "health_transitions": self.transitions,
            "cycles": self.cycles,
            "seconds": round(self.seconds, 1),
            "params": self.params,
        }


def fleet(nodes: int) -> list[NodeSpec]:
    return [
        NodeSpec(
            f"n{i:05d}",
            MODEL,
            GPUS_PER_NODE,
            192_000,
            2_097_152,
            region="sim",
            rack=f"r{i // NODES_PER_RACK:04d}",
            block=f"b{i // (NODES_PER_RACK * 32):03d}",
        )
        for i in range(nodes)
    ]


class _Replay:
    def __init__(self, p: Params, policy: str, faults: list[Fault], bg: list[philly.Job]):
        self.p, self.policy = p, policy
        self.smart = policy == "default"
        self.loop = policy != "manual"
        self.nodes = p.gpus // GPUS_PER_NODE
        self.spares = _spare_nodes(p)
        hot = hot_spares_for(p) if p.hot_spares is None else p.hot_spares
        self.hot = min(hot, self.spares) if self.smart else 0
        self.job_nodes = self.nodes - self.spares
        self.snap = Snapshot(fleet(self.nodes))
        quotas = {j.tenant: TenantQuota() for j in bg}
        quotas[JOB] = TenantQuota(guaranteed={MODEL: p.gpus * 1000})
        self.sched = Scheduler(self.snap, quotas, BASELINES["default"])
        self.res = Result(
            policy, p.gpus, p.days, self.job_nodes * GPUS_PER_NODE, self.spares, self.hot
        )
        self.res.params = {
            k: v for k, v in vars(p).items() if k not in ("causes", "gpus", "days")
        } | {"warned": max((c.warned for c in p.causes), default=0.0)}
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.faults = faults
        self.bg = {f"j{j.idx}": replace(j) for j in bg}
        # What the queueing core sees.
        self.pending: dict[str, Workload] = {}
        self.running: dict[str, Workload] = {}
        self.starting: dict[str, float] = {}
        # Nodes held whole by the job (its replicas) or by hot spares: node -> (workload, alloc).
        self.held: dict[int, tuple[str, int]] = {}
        self.job: set[int] = set()  # nodes running a replica of the job
        self.spare_nodes: set[int] = set()  # nodes held as warm spares
        self.health: dict[tuple[int, int | None], Health] = {}
        self.out_until: dict[int, float] = {}
        self.counter = 0
        # The job's clock.
        self.up = False
        self.up_since = 0.0
        self.saved = 0.0  # progress at the last checkpoint: where the job restarts from
        self.down_since = 0.0
        self.phase = ""  # while down: detection | waiting_for_capacity | restart
        self.phase_since = 0.0
        self.tau = p.checkpoint_every_s
        self.advised = self.tau  # default: Young/Daly from the measured fault rate
        self.undetected = 0  # faults on the job not yet located
        self.need = 0  # replacement replicas not yet running
        self.cold = False  # some replacement is not a warm spare
        self.up_version = 0
        self.seen_faults = 0

    def push(self, t: float, kind: int, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, data))

    # --- the job's clock ------------------------------------------------------------------

    def _progress(self, t: float) -> tuple[float, float, float]:
        """Up since `up_since`: (progress now, progress saved, seconds spent writing)."""
        x = t - self.up_since
        period = self.tau + self.p.checkpoint_cost_s
        # (an instant computed as up_since + k x period must count checkpoint k as written)
        k = math.floor(x / period + 1e-9)
        r = max(0.0, x - k * period)
        done = k * self.tau + min(r, self.tau)
        writing = k * self.p.checkpoint_cost_s + max(0.0, r - self.tau)
        return self.saved + done, self.saved + k * self.tau, writing

    def _next_checkpoint(self, t: float) -> float:
        period = self.tau + self.p.checkpoint_cost_s
        return self.up_since + (math.floor((t - self.up_since) / period) + 1) * period

    def _add(self, part: str, seconds: float) -> None:
        self.res.parts[part] = self.res.parts.get(part, 0.0) + seconds

    def _stop_job(self, t: float, planned: bool) -> None:
        """The job stops at t: a fault, or (`planned`) a move right after a checkpoint."""
        now, saved, writing = self._progress(t)
        self._add("progress", saved - self.saved)
        self._add("recomputation", now - saved)
        self._add("checkpointing", writing)
        self.saved = saved
        self.up = False
        self.down_since = self.phase_since = t
        self.phase = ""
        if not planned:
            self.res.interruptions += 1

    def _down_phase(self, t: float) -> None:
        """While down, account the time since the last change to the phase it was in, and
        restart the job once nothing is missing."""
        if self.up:
            return
        if self.phase:
            self._add(self.phase, t - self.phase_since)
        self.phase_since = t
        if self.undetected:
            self.phase = "detection"
        elif self.need:
            self.phase = "waiting_for_capacity"
        else:
            if self.phase != "restart":
                self.up_version += 1
                took = self.p.restart_s + (self.p.provision_s if self.cold else 0.0)
                self.push(t + took, UP, self.up_version)
            self.phase = "restart"

    # --- health -----------------------------------------------------------------------------

    def _move(self, key: tuple[int, int | None], to: Health) -> None:
        cur = self.health.get(key, Health.healthy)
        actor = Actor.operator if cur is Health.out_of_service else Actor.system
        check(cur, to, actor, node=key[1] is None)
        self.health[key] = to
        self.res.transitions += 1

    def _take_out(self, t: float, f: Fault, rule: Rule | None) -> bool:
        """Take out what the rule's effect says (through the state table) and schedule its
        return. Whether whole-node work on the node stops."""
        if rule is None:
            return False
        scope, repair = actions.EFFECT[rule.action]
        if scope is Scope.none:
            return False
        key: tuple[int, int | None] = (f.node, None if scope >= Scope.node else f.gpu)
        if self.health.get(key, Health.healthy) not in IN_SERVICE:
            return True  # out already
        self._move(key, Health.quarantined)
        name = f"n{f.node:05d}"
        if key[1] is None:
            self.snap.set_schedulable(name, False)
        else:
            self.snap.set_gpu_health(name, f.gpu, FAILED)
        delay = 0.0 if self.loop else self.p.human_s  # manual: a human runs the repair
        if f.back and repair in (Repair.reset, Repair.reboot):
            took = self.p.reset_s if repair is Repair.reset else self.p.reboot_s
            for state in (Health.draining, Health.repairing, Health.validating):
                self._move(key, state)
            back = t + delay + took + self.p.validate_s
        else:
            self._move(key, Health.out_of_service)
            back = t + delay + self.p.service_h * 3600
        self.push(back, REPAIRED, key)
        return True

    # --- the replay -------------------------------------------------------------------------

    def run(self) -> Result:
        wall = time.perf_counter()
        p = self.p
        horizon = p.days * DAY
        self.res.bg_jobs = len(self.bg)
        self.res.faults = len(self.faults)
        for f in self.faults:
            self.push(f.at, FAULT, f)
            if f.warned:
                self.push(max(0.0, f.at - p.warn_lead_h * 3600), WARN, f)
        for jid, j in self.bg.items():
            self.push(j.submit, BG_ARRIVE, jid)
        # The job first, on every node but the spare pool; then the hot spares.
        req = Request(JOB, JOB, Tier.DEDICATED, Shape(gpus=GPUS_PER_NODE), replicas=self.job_nodes)
        self.pending[JOB] = Workload(JOB, req, "production", 0.0, 1e12)
        for _ in range(self.hot):
            self._submit("spare", 0.0)
        self._cycle(0.0)
        assert len(self.job) == self.job_nodes, "the job did not fit its fleet"
        self.up, self.up_since = True, 0.0
        while self.events and self.events[0][0] < horizon:
            t = self.events[0][0]
            changed = False
            while self.events and self.events[0][0] == t:
                _, kind, _, data = heapq.heappop(self.events)
                changed |= self._handle(t, kind, data)
            if changed and self.pending:
                self._cycle(t)
        if self.up:  # the work since the last checkpoint counts: it would be saved next
            now, _saved, writing = self._progress(horizon)
            self._add("progress", now - self.saved)
            self._add("checkpointing", writing)
        elif self.phase:
            self._add(self.phase, horizon - self.phase_since)
        self.res.progress_s = self.res.parts.get("progress", 0.0)
        self.res.checkpoint_interval_s = self.tau
        self.res.seconds = time.perf_counter() - wall
        return self.res

    def _submit(self, kind: str, t: float) -> str:
        """A hot spare or a replacement replica of the job: one whole node, production."""
        wid = f"{kind}{self.counter}"
        self.counter += 1
        req = Request(wid, JOB, Tier.DEDICATED, Shape(gpus=GPUS_PER_NODE))
        self.pending[wid] = Workload(
            wid, req, "production", t, 1e12, expedited=kind == "replace" and self.loop
        )
        return wid

    def _handle(self, t: float, kind: int, data: Any) -> bool:
        if kind == FAULT:
            assert isinstance(data, Fault)
            return self._fault(t, data)
        if kind == DETECTED:
            f, on_job = data
            return self._detected(t, f, on_job)
        if kind == WARN:
            assert isinstance(data, Fault)
            self._warned(t, data)
            return False
        if kind == MOVE:  # a planned move off a suspect GPU, right after a checkpoint
            f, version = data
            return self._planned_move(t, f, version)
        if kind == REPAIRED:
            node, gpu = data
            if self.health[(node, gpu)] is Health.out_of_service:
                self._move((node, gpu), Health.validating)  # an operator returns it
            self._move((node, gpu), Health.healthy)
            name = f"n{node:05d}"
            if gpu is None:
                self.snap.set_schedulable(name, True)
            else:
                self.snap.set_gpu_health(name, gpu, 0)
            self.snap.commit()
            return True
        if kind == UP:
            if data != self.up_version or self.up or self.phase != "restart":
                return False
            self._add("restart", t - self.phase_since)
            self.phase = ""
            self.up, self.up_since, self.cold = True, t, False
            self.tau = self.advised  # the interval is a launch parameter: the advice now
            self.res.mttr.append(t - self.down_since)
            return False
        if kind == BG_ARRIVE:
            jid = str(data)
            j = self.bg[jid]
            j.workload = Workload(
                jid,
                philly.request_of(j),
                # Nothing in the background outranks the job's capacity.
                j.priority if j.priority != "production" else "training",
                t,
                j.max_runtime,
                checkpoint_cost=j.checkpoint_cost,
                checkpoint_every=j.checkpoint_every,
            )
            self.pending[jid] = j.workload
            return True
        if kind == BG_FINISH:
            jid, version = data
            j = self.bg[jid]
            if version != j.version or jid not in self.running:
                return False
            for aid in self.running.pop(jid).alloc_ids:
                self.snap.release(aid)
            self.res.bg_finished += 1
            self.res.bg_jct.append(t - j.submit)
            return True
        if kind == STOP:  # an evicted background job leaves after its grace period
            jid = str(data)
            w = self.bg[jid].workload
            assert w is not None
            self.pending[jid] = w
            return True
        if kind == START:
            wid = str(data)
            if self.starting.pop(wid, None) is not None:
                self._started(t, wid)
            return False
        raise AssertionError(kind)

    def _detect_delay(self, f: Fault) -> float:
        """Fault to the control plane knowing which hardware failed."""
        p = self.p
        d = {
            "hang": p.stall_detect_s if self.smart else p.hang_timeout_s,
            "heartbeat": p.heartbeat_s,
            "telemetry": p.detect_s,
        }.get(f.cause.detect, 0.0)
        return d if self.loop else d + p.human_s

    def _fault(self, t: float, f: Fault) -> bool:
        self.seen_faults += 1
        if self.smart:  # Young/Daly from the fault rate measured over the fleet so far
            rate = self.seen_faults / (max(t, 3600.0) * self.nodes * GPUS_PER_NODE)
            mtbf = 1 / (rate * self.job_nodes * GPUS_PER_NODE)
            self.advised = max(30.0, young_daly(self.p.checkpoint_cost_s, mtbf))
        if f.avoided or self.health.get((f.node, None), Health.healthy) not in IN_SERVICE:
            return False  # repaired before it struck, or the node is out: nothing runs there
        on_job = f.node in self.job
        if on_job:
            if self.up:
                self._stop_job(t, planned=False)
            self.undetected += 1
            self._down_phase(t)
        self.push(t + self._detect_delay(f), DETECTED, (f, on_job))
        return False

    def _detected(self, t: float, f: Fault, on_job: bool) -> bool:
        rule = f.cause.rule
        if on_job:
            self.undetected -= 1
            if f.node in self.job and self._take_out(t, f, rule):
                self._lose_replica(t, f.node)
            self._down_phase(t)
            return True
        # Not the job's: the work on the node stops (background work is requeued), the
        # hardware goes out, a hot spare there is replaced.
        scope = actions.EFFECT[rule.action][0] if rule is not None else Scope.none
        self._take_out(t, f, rule)
        # The GPU's work stops (an application error, a GPU reset); a node's for node scope.
        gpus_hit = {f.gpu} if scope <= Scope.gpu else set(range(GPUS_PER_NODE))
        for wid in [
            wid
            for wid, w in self.running.items()
            if wid in self.bg
            and any(
                self.snap.allocs[a].node == f.node and gpus_hit & set(self.snap.allocs[a].slots)
                for a in w.alloc_ids
            )
        ]:
            self._bg_fault(t, wid)
        held = self.held.get(f.node)
        if held is not None and held[0].startswith("spare") and scope >= Scope.gpu:
            self._drop_spare(f.node)
            self._submit("spare", t)
        self.snap.commit()
        return True

    def _warned(self, t: float, f: Fault) -> None:
        """A watch-level signal on the GPU: it turns suspect. The default policy moves the job
        off it at its next checkpoint, if that comes before the fault."""
        if not self.loop or self.health.get((f.node, f.gpu), Health.healthy) is not Health.healthy:
            return
        self._move((f.node, f.gpu), Health.suspect)
        if self.smart and self.up and f.node in self.job:
            at = self._next_checkpoint(t)
            if at < f.at:
                self.push(at, MOVE, (f, self.up_version))

    def _planned_move(self, t: float, f: Fault, version: int) -> bool:
        # Planned against this run's checkpoints: a run since restarted has its own.
        if not (self.up and f.node in self.job) or version != self.up_version:
            return False
        self._stop_job(t, planned=True)
        self.res.avoided += 1
        # The suspect GPU goes for its repair now: the fault it announced never strikes.
        f.avoided = True
        self._take_out(t, replace(f, back=True), f.cause.rule or _HANG)
        self._lose_replica(t, f.node)
        self._down_phase(t)
        return True

    def _drop_spare(self, node: int) -> None:
        self.spare_nodes.discard(node)
        wid, aid = self.held.pop(node)
        self.snap.release(aid)
        self.running.pop(wid, None)

    def _lose_replica(self, t: float, node: int) -> None:
        """The job's replica on `node` is gone: release it and ask for a replacement; with a
        warm spare, it lands there."""
        wid, aid = self.held.pop(node)
        self.snap.release(aid)
        self.job.discard(node)
        w = self.running[wid]
        w.alloc_ids = tuple(a for a in w.alloc_ids if a != aid)
        if not w.alloc_ids:
            del self.running[wid]
        spare = min(self.spare_nodes, default=None)
        if spare is not None:
            self._drop_spare(spare)
            self._submit("spare", t)  # replenished from the pool, preempting background work
        else:
            self.cold = True
        self._submit("replace", t)
        self.need += 1

    def _bg_fault(self, t: float, wid: str) -> None:
        j = self.bg[wid]
        w = self.running.pop(wid)
        if w.started_at is not None and w.started_at <= t:
            self.res.bg_lost_gpu_s += w.lost_gpu_seconds(t)
            j.done += w.last_checkpoint(t) - w.started_at
        for aid in w.alloc_ids:
            self.snap.release(aid)
        self.starting.pop(wid, None)
        j.version += 1
        w.alloc_ids, w.started_at, w.last_checkpoint_at = (), None, None
        w.expedited = self.loop
        self.pending[wid] = w

    def _started(self, t: float, wid: str) -> None:
        if wid in self.bg:
            j = self.bg[wid]
            j.version += 1
            self.running[wid].started_at = t
            self.push(t + max(1.0, j.duration - j.done), BG_FINISH, (wid, j.version))
        elif wid.startswith("replace"):
            self.need -= 1
            self._down_phase(t)

    def _cycle(self, t: float) -> None:
        result = self.sched.cycle(t, list(self.pending.values()), list(self.running.values()))
        self.snap.commit()
        self.res.cycles += 1
        for ev in result.evictions:
            w = self.running.pop(ev.workload)
            j = self.bg[ev.workload]
            saved = t if ev.lost_gpu_seconds == 0 else w.last_checkpoint(min(t, ev.deadline))
            if w.started_at is not None and w.started_at <= t:
                j.done += max(0.0, saved - w.started_at)
                self.res.bg_lost_gpu_s += max(0.0, ev.deadline - saved) * j.gpus
            self.starting.pop(ev.workload, None)
            j.version += 1
            w.started_at, w.alloc_ids, w.preempted_at = None, (), t
            w.last_checkpoint_at = None
            self.push(ev.deadline, STOP, ev.workload)
        for adm in result.admissions:
            wid = adm.workload
            w = self.pending.pop(wid)
            w.alloc_ids = tuple(b.alloc_id for b in adm.bindings)
            self.running[wid] = w
            if wid not in self.bg:
                for b in adm.bindings:
                    n = self.snap.node_index[b.node]
                    self.held[n] = (wid, b.alloc_id)
                    if wid.startswith("spare"):
                        self.spare_nodes.add(n)
                    else:
                        self.job.add(n)
            if adm.start_at > t:
                self.starting[wid] = adm.start_at
                w.started_at = adm.start_at
                self.push(adm.start_at, START, wid)
            else:
                self._started(t, wid)


def replay(p: Params, policy: str, faults: list[Fault], bg: list[philly.Job]) -> Result:
    """Replay the job and the background mix under `policy`, on the given faults."""
    return _Replay(p, policy, [replace(f) for f in faults], bg).run()
