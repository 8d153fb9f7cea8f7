"""Fair-share queueing over a snapshot: quotas with borrowing, priorities, checkpoint-aware
preemption, reservations with backfill, and what-if answers. Pure: decisions, no I/O.

One scheduling cycle runs named phases in a configured order (default: reclaim, allocate,
preempt, backfill, defragment). Every phase reads and changes one `_Cycle` (the snapshot, usage
per tenant and GPU model, the queue) and appends its decisions to the `CycleResult`:

- **reclaim**: a tenant below its guarantee whose work does not fit evicts *borrowed* work
  (of tenants above their guarantee, never of a higher priority), cheapest loss first;
- **allocate**: the queue in order (arrival, strict priority, or priority then fair share;
  work waiting longer than its declared runtime goes first whatever its class),
  admitting what fits under each tenant's limit. What does not fit is skipped (`skip`), ends
  the walk (`stop`), or ends the walk and goes to the backfill phase for a reservation
  (`reserve`). A reservation that has come due is served before the walk;
- **preempt**: a blocked workload evicts workloads of a strictly lower priority (or of a
  preemptible class), cheapest loss first;
- **backfill**: the blocked head gets a reservation (GPUs and the earliest start from the
  declared maximum runtimes of what runs), and the rest of the queue may start only where it
  cannot delay it: on capacity outside the reservation, or ending before it starts;
- **defragment**: multi-GPU work still waiting while the free GPUs lie scattered moves small
  work (never of a higher priority) off the nodes closest to free, onto free GPUs elsewhere.

Victims stop after the grace period, or once their checkpoint is written when that takes
longer but no longer than `checkpoint_wait`; only work that can checkpoint so is moved.

By default the queue is work-conserving: a tenant may use what the others cannot. With
`share_cap`, every phase treats a tenant holding that multiple of its fair share (weighted max-min
among tenants with work waiting) like one at its limit: stricter shares, longer queues.

Units: quotas and usage are GPU-equivalents in milli (whole GPU 1000, MIG slice memory/8, a
fractional share its milli), per GPU model.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from app.placement.engine import Engine, Plan
from app.placement.isolation import Tier, Unit
from app.placement.mig import PROFILES
from app.placement.model import Binding, Reconfiguration, Request
from app.placement.snapshot import Snapshot

RESERVATION_TENANT = "__reservation__"


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PriorityClass:
    name: str
    value: int
    # Preemptible work is cheaper and can always be evicted (no minimum runtime, no cool-down).
    preemptible: bool = False


DEFAULT_PRIORITY_CLASSES: dict[str, PriorityClass] = {
    p.name: p
    for p in (
        PriorityClass("production", 1000),
        PriorityClass("training", 500),
        PriorityClass("research", 100),
        PriorityClass("preemptible", 0, preemptible=True),
    )
}


@dataclass(frozen=True)
class TenantQuota:
    """Per GPU model, in GPU-equivalent milli. A model missing from `limit` has no limit beyond
    the fleet; a model missing from `guaranteed` has no guarantee (all its use is borrowed)."""

    guaranteed: Mapping[str, int] = field(default_factory=dict)
    limit: Mapping[str, int] = field(default_factory=dict)
    weight: float = 1.0

    def guarantee(self, model: str) -> int:
        return self.guaranteed.get(model, 0)

    def cap(self, model: str) -> int | None:
        return self.limit.get(model)


ORDERS = ("arrival", "priority", "fair-share")
ON_BLOCKED = ("skip", "stop", "reserve")


@dataclass(frozen=True)
class QueueConfig:
    phases: tuple[str, ...] = ("reclaim", "allocate", "preempt", "backfill", "defragment")
    order: str = "fair-share"
    on_blocked: str = "reserve"
    placement_policy: str = "best-fit"
    max_reservations: int = 1
    half_life: float = 24 * 3600.0  # usage history decay (seconds)
    history_weight: float = 0.5  # fair share: 0 = current use only, 1 = decayed history only
    grace_period: float = 120.0  # a victim may checkpoint for this long before it stops
    # ... or longer, up to this, when its checkpoint takes longer (0: the grace period only).
    checkpoint_wait: float = 300.0
    min_runtime: float = 600.0  # never evicted before running this long (non-preemptible)
    cooldown: float = 1800.0  # never evicted again this soon after an eviction
    starvation_factor: float = 1.0  # waited this many times its max runtime: goes first
    # True: priority orders the whole queue and a higher class may evict any tenant's lower
    # class. False: priority orders work within a tenant; across tenants the fair share decides,
    # and only preemptible work of other tenants may be evicted for priority.
    priority_across_tenants: bool = True
    # None: work-conserving, a tenant may use whatever the others leave. A number >= 1: a tenant
    # holding this multiple of its fair share of a GPU model (the weighted max-min split among
    # tenants with work waiting for it, never below its guarantee) starts nothing more there
    # while others wait. Below it, any workload may start, so none starves. Stricter shares,
    # longer queues.
    share_cap: float | None = None
    max_victims: int = 64
    # Defragment: per cycle, waiting multi-GPU workloads that may move small work off the nodes
    # closest to free, moving at most this fraction of the GPUs they need.
    defragment_per_cycle: int = 4
    defragment_max_moved: float = 0.75  # below 1: a node to clear has a free GPU already
    defragment_depth: int = 32  # waiting workloads the phase examines per cycle
    reclaim_depth: int = 4  # per tenant and cycle: pending workloads that may reclaim
    backfill_depth: int = 200  # workloads the backfill phase examines per cycle
    priority_classes: Mapping[str, PriorityClass] = field(
        default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES)
    )

    def validate(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown:
            raise ValueError(f"unknown phases {unknown}; known: {', '.join(PHASES)}")
        if self.order not in ORDERS:
            raise ValueError(f"order is one of {ORDERS}")
        if self.on_blocked not in ON_BLOCKED:
            raise ValueError(f"on_blocked is one of {ON_BLOCKED}")
        if not 0 <= self.defragment_max_moved < 1:
            raise ValueError("0 <= defragment_max_moved < 1")
        if self.share_cap is not None and self.share_cap < 1:
            raise ValueError("share_cap is None or at least 1")
        if self.half_life <= 0 or not 0 <= self.history_weight <= 1:
            raise ValueError("half_life > 0 and 0 <= history_weight <= 1")


# --- workloads and decisions --------------------------------------------------------------------


@dataclass
class Workload:
    """A queued or running workload as the scheduler sees it.

    Running workloads carry the snapshot allocations they hold (`alloc_ids`), when the current
    run started, their last checkpoint and their last eviction."""

    id: str
    request: Request
    priority: str
    submitted_at: float
    max_runtime: float  # declared; the workload is stopped when it runs longer
    checkpoint_cost: float = 0.0  # seconds to write a checkpoint
    started_at: float | None = None
    last_checkpoint_at: float | None = None
    preempted_at: float | None = None
    alloc_ids: tuple[int, ...] = ()
    # Periodic checkpoints (seconds of run time); the last one counts if later than reported.
    checkpoint_every: float | None = None
    # Requeued after a hardware fault that was not its own: ahead of its priority peers.
    expedited: bool = False
    _charge: tuple[tuple[int, ...], list[tuple[str, int]], list[tuple[str, int]]] | None = field(
        default=None, repr=False, compare=False
    )
    _fit_key: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def gpu_milli(self) -> int:
        return self.request.shape.gpu_milli * self.request.replicas

    def last_checkpoint(self, now: float) -> float:
        assert self.started_at is not None, "only running workloads have checkpoints"
        last = self.started_at
        if self.last_checkpoint_at is not None:
            last = max(last, self.last_checkpoint_at)
        if self.checkpoint_every:
            k = (now - self.started_at) // self.checkpoint_every
            last = max(last, self.started_at + k * self.checkpoint_every)
        return last

    def lost_gpu_seconds(self, now: float) -> float:
        """Work lost if stopped now without a new checkpoint: GPUs x time since the last one."""
        return max(0.0, now - self.last_checkpoint(now)) * self.gpu_milli / 1000


@dataclass(frozen=True)
class Admission:
    workload: str
    bindings: tuple[Binding, ...]
    start_at: float  # after the victims' grace period when it preempted
    borrowed: bool  # beyond its tenant's guarantee: may be reclaimed
    phase: str
    victims: tuple[str, ...] = ()


@dataclass(frozen=True)
class Eviction:
    workload: str
    reason: str  # reclaim | fair-share | priority
    by: str  # the workload it makes room for
    deadline: float  # stops then (checkpoints during the grace period)
    lost_gpu_seconds: float  # if it cannot checkpoint within the grace period


@dataclass(frozen=True)
class Reservation:
    workload: str
    start_at: float
    gpus: tuple[tuple[str, int], ...]


@dataclass
class CycleResult:
    now: float
    admissions: list[Admission] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)  # workload -> why it waits
    # GPUs the admissions need in (or out of) MIG mode; they are idle.
    reconfigurations: list[Reconfiguration] = field(default_factory=list)


@dataclass(frozen=True)
class WhatIf:
    """Where a prospective workload would land now, whom it would preempt, or when it starts."""

    placeable_now: bool
    bindings: tuple[Binding, ...]
    preempts: tuple[str, ...]
    expected_start: float | None  # None: cannot start under its quota and the fleet
    reason: str


# --- state carried between cycles ---------------------------------------------------------------


@dataclass
class UsageHistory:
    """Decayed usage per (tenant, model) in GPU-milli-seconds, with a configurable half-life."""

    half_life: float
    at: float | None = None
    decayed: dict[tuple[str, str], float] = field(default_factory=dict)

    def advance(self, now: float, usage: Mapping[tuple[str, str], int]) -> None:
        """Integrate `usage` (held since the last call) up to `now`, decaying what was before."""
        if self.at is None or now <= self.at:
            self.at = now if self.at is None else self.at
            return
        lam = math.log(2) / self.half_life
        decay = math.exp(-lam * (now - self.at))
        gain = (1 - decay) / lam
        for key in set(self.decayed) | set(usage):
            value = self.decayed.get(key, 0.0) * decay + usage.get(key, 0) * gain
            if value < 1e-3:
                self.decayed.pop(key, None)
            else:
                self.decayed[key] = value
        self.at = now

    def average(self, key: tuple[str, str]) -> float:
        """The decayed usage as an average rate (GPU-milli): constant use u converges to u."""
        return self.decayed.get(key, 0.0) * math.log(2) / self.half_life


# --- the scheduler ------------------------------------------------------------------------------


class Scheduler:
    """Runs scheduling cycles over one snapshot (which it changes: admissions are allocated,
    evictions released; the caller commits or rolls back the snapshot)."""

    def __init__(
        self,
        snapshot: Snapshot,
        tenants: Mapping[str, TenantQuota],
        config: QueueConfig | None = None,
        *,
        policy=None,
        history: UsageHistory | None = None,
    ):
        from app.placement.policies import make_policy

        self.config = config or QueueConfig()
        self.config.validate()
        self.snap = snapshot
        self.tenants = dict(tenants)
        self.engine = Engine(snapshot, policy or make_policy(self.config.placement_policy, seed=0))
        self.history = history or UsageHistory(self.config.half_life)
        # Reservations of the last cycle, kept on the same GPUs while their workloads wait.
        self.reservations: dict[str, Reservation] = {}
        self.capacity = {
            name: 1000 * int(snapshot.node_ngpu[snapshot.node_model == i].sum())
            for i, name in enumerate(snapshot.model_names)
        }

    def quota(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant) or TenantQuota()

    def prio(self, w: Workload) -> PriorityClass:
        try:
            return self.config.priority_classes[w.priority]
        except KeyError:
            raise ValueError(f"workload {w.id}: unknown priority class {w.priority!r}") from None

    def cycle(self, now: float, pending: list[Workload], running: list[Workload]) -> CycleResult:
        """One scheduling cycle: the configured phases in order."""
        c = _Cycle(self, now, pending, running)
        self.history.advance(now, c.usage_by_key())
        c.carry(self.reservations)
        for name in self.config.phases:
            PHASES[name](c)
        c.finish()
        self.reservations = {r.workload: r for r in c.result.reservations}
        return c.result

    def what_if(
        self, workload: Workload, now: float, pending: list[Workload], running: list[Workload]
    ) -> WhatIf:
        """The decision for `workload` if it were at the head of its queue now; changes nothing."""
        plan = Plan(self.snap)
        mark = plan.checkpoint()
        try:
            c = _Cycle(self, now, pending, running, plan=plan)
            c.carry(self.reservations)
            over = c.over_limit(workload)
            if over:
                return WhatIf(False, (), (), None, over)
            bindings = c.try_place(workload)
            if bindings is not None:
                return WhatIf(True, bindings, (), now, "fits now")
            for mode in ("reclaim", "priority"):
                victims = c.victims_for(workload, mode=mode)
                if victims is not None:
                    placed = c.try_place(workload)
                    assert placed is not None
                    start = max(now + c.grace(v) for v in victims)
                    return WhatIf(
                        True,
                        placed,
                        tuple(v.id for v in victims),
                        start,
                        "reclaims borrowed capacity"
                        if mode == "reclaim"
                        else "preempts lower priority",
                    )
            res = c.reservation_for(workload)
            if res is None:
                return WhatIf(False, (), (), None, "does not fit the fleet")
            return WhatIf(False, (), (), res.start_at, "waits for running work to end")
        finally:
            plan.rollback(mark)


# --- one cycle ----------------------------------------------------------------------------------


class _Cycle:
    def __init__(
        self,
        sched: Scheduler,
        now: float,
        pending: list[Workload],
        running: list[Workload],
        plan: Plan | None = None,
    ):
        self.s = sched
        self.cfg = sched.config
        self.now = now
        self.snap = sched.snap
        self.plan = plan or Plan(self.snap)
        self.result = CycleResult(now)
        self.running = {w.id: w for w in running}
        self.queue = [w for w in pending if w.started_at is None or not w.alloc_ids]
        self.by_id = {w.id: w for w in self.queue}
        self.done: set[str] = set()  # admitted or given up for this cycle
        self.evicted: set[str] = set()
        self.usage: dict[str, dict[str, int]] = {}
        self.shares: dict[str, float] = {}
        for w in running:
            self._charge(w)
            for model, milli in w._charge[2]:  # type: ignore[index]
                self._add(w.tenant, model, milli)
        # (tenant, model) -> GPU milli above which the tenant starts nothing more (share_cap).
        self.fair_caps = self._fair_caps() if self.cfg.share_cap is not None else {}
        self.blocked: list[Workload] = []
        self.walk: _Walk | None = None
        # Reservations held in this cycle (by workload), and the placeholder allocations that
        # keep their free GPUs out of reach of everyone else.
        self.reserved: dict[str, tuple[Reservation, frozenset[tuple[int, int]]]] = {}
        self.phantoms: dict[str, list[int]] = {}
        self.fail_cache: set[tuple] = set()
        self.fail_unheld: set[tuple] = set()  # the same, ignoring reservations
        self.victim_fail: set[tuple] = set()  # (shape, kind, tenant, priority) found no victims

    # usage ---------------------------------------------------------------------------------

    def _charge(self, w: Workload) -> list[tuple[str, int]]:
        """(model, GPU-milli) per allocation of a running workload (cached on it)."""
        cached = w._charge
        # `alloc_ids` is replaced, never changed in place: identity is the cheap test.
        if cached is not None and cached[0] is w.alloc_ids:
            return cached[1]
        snap = self.snap
        out = []
        totals: dict[str, int] = {}
        for aid in w.alloc_ids:
            a = snap.allocs[aid]
            model, milli = snap.model_names[int(snap.node_model[a.node])], _milli(a)
            out.append((model, milli))
            totals[model] = totals.get(model, 0) + milli
        # Per allocation, and per model (a gang of thousands is charged in one step per cycle).
        w._charge = (w.alloc_ids, out, list(totals.items()))
        return out

    def _add(self, tenant: str, model: str, milli: int) -> None:
        self.shares.pop(tenant, None)
        per = self.usage.setdefault(tenant, {})
        per[model] = per.get(model, 0) + milli

    def usage_by_key(self) -> dict[tuple[str, str], int]:
        return {(t, m): v for t, per in self.usage.items() for m, v in per.items()}

    def used(self, tenant: str, model: str) -> int:
        return self.usage.get(tenant, {}).get(model, 0)

    def share(self, tenant: str) -> float:
        """Dominant share over GPU models of current and decayed use, divided by the weight."""
        cached = self.shares.get(tenant)
        if cached is None:
            cached = self.shares[tenant] = self._share(tenant)
        return cached

    def _share(self, tenant: str) -> float:
        cfg, hist = self.cfg, self.s.history
        best = 0.0
        per = self.usage.get(tenant, {})
        models = set(per) | {m for (t, m) in hist.decayed if t == tenant}
        for m in models:
            cap = self.s.capacity.get(m)
            if not cap:
                continue
            eff = (1 - cfg.history_weight) * per.get(m, 0) + cfg.history_weight * hist.average(
                (tenant, m)
            )
            best = max(best, eff / cap)
        return best / max(self.s.quota(tenant).weight, 1e-9)

    def models_of(self, bindings: Iterable[Binding]) -> dict[str, int]:
        snap, out = self.snap, dict[str, int]()
        for b in bindings:
            a = snap.allocs[b.alloc_id]
            model = snap.model_names[int(snap.node_model[a.node])]
            out[model] = out.get(model, 0) + _milli(a)
        return out

    def starving(self, w: Workload) -> bool:
        return self.now - w.submitted_at >= self.cfg.starvation_factor * w.max_runtime

    def _fair_caps(self) -> dict[tuple[str, str], float]:
        """Per (tenant, GPU model) with work waiting: share_cap times the tenant's weighted
        max-min fair share of what tenants without waiting work leave of the model (demand: use
        plus waiting work, which counts on every model it allows), never below its guarantee."""
        assert self.cfg.share_cap is not None
        snap, engine = self.snap, self.s.engine
        waiting: dict[str, dict[str, int]] = {}
        for w in self.queue:
            req = w.request
            per = waiting.setdefault(w.tenant, {})
            for m in engine.allowed_models(req.shape, req.tier):
                name = snap.model_names[m]
                per[name] = per.get(name, 0) + w.gpu_milli
        caps: dict[tuple[str, str], float] = {}
        for model, capacity in self.s.capacity.items():
            demand = {
                t: self.used(t, model) + per[model] for t, per in waiting.items() if model in per
            }
            if len(demand) < 2:
                continue  # alone, its fair share is all that is left
            left = capacity - sum(
                per.get(model, 0) for t, per in self.usage.items() if t not in demand
            )
            weights = {t: max(self.s.quota(t).weight, 1e-9) for t in demand}
            for t, fair in water_fill(left, demand, weights).items():
                caps[(t, model)] = max(self.s.quota(t).guarantee(model), self.cfg.share_cap * fair)
        return caps

    def over_limit(self, w: Workload, by_model: Mapping[str, int] | None = None) -> str | None:
        """Why admitting `w` (charged as `by_model`, default: each allowed model) would exceed
        its tenant's limit or, under `share_cap`, its fair share; None if it would not."""
        q = self.s.quota(w.tenant)
        if not q.limit and not self.fair_caps:
            return None
        if by_model is None:
            by_model = {m: w.gpu_milli for m in w.request.shape.models or self.snap.model_names}
            blocked = all  # it may go to any allowed model: blocked only if all are
        else:
            blocked = any

        def over(m: str) -> bool:
            cap = q.cap(m)
            return cap is not None and self.used(w.tenant, m) + by_model[m] > cap

        def at_share(m: str) -> bool:
            cap = self.fair_caps.get((w.tenant, m))
            return cap is not None and self.used(w.tenant, m) >= cap

        if q.limit and blocked(over(m) for m in by_model):
            return "over its tenant's limit"
        if self.fair_caps and blocked(at_share(m) for m in by_model):
            return "at its fair share while other tenants wait"
        return None

    def borrowed(self, tenant: str, by_model: Mapping[str, int]) -> bool:
        q = self.s.quota(tenant)
        return any(self.used(tenant, m) > q.guarantee(m) for m in by_model)

    # placement -----------------------------------------------------------------------------

    def free_whole(self, models: Iterable[int]) -> int:
        whole = self.snap.whole
        wanted = set(models)
        return sum(k * len(b) for (m, k), b in whole.items() if m in wanted)

    @staticmethod
    def _cache_key(w: Workload) -> tuple | None:
        """Whole-GPU shapes that fail once fail for the rest of the walk; () for other shapes."""
        key = w._fit_key
        if key is None:
            r = w.request
            if not r.shape.gpus or r.shape.cpu_milli or r.shape.mem_mib:
                key = ()
            else:
                key = (r.tier, r.shape.gpus, r.replicas, r.shape.models, r.topology)
                key += (r.same_perf_class, r.avoid)
            w._fit_key = key
        return key or None

    def known_to_fail(self, w: Workload) -> bool:
        key = self._cache_key(w)
        return key is not None and key in self.fail_cache

    def try_place(self, w: Workload, *, limit_check: bool = True) -> tuple[Binding, ...] | None:
        """Place `w` (recorded in the plan) or return None with nothing changed. Failures of
        whole-GPU shapes are remembered for the cycle (capacity only shrinks within a walk)."""
        if w.id in self.reserved:
            return self._place_owner(w, limit_check)
        req = w.request
        key = self._cache_key(w)
        if key is not None:
            if key in self.fail_cache:
                return None
            models = self.s.engine.allowed_models(req.shape, req.tier)
            if self.free_whole(models) < req.shape.gpus * req.replicas:
                self.fail_cache.add(key)
                return None
        mark = self.plan.checkpoint()
        outcome = self.s.engine.place_one(req, self.plan)
        if not outcome.placed:
            self.plan.rollback(mark)
            if key is not None:
                self.fail_cache.add(key)
            return None
        if limit_check and self.over_limit(w, self.models_of(outcome.bindings)):
            self.plan.rollback(mark)
            return None
        self.plan.outcomes.append(outcome)
        return tuple(outcome.bindings)

    def _place_owner(self, w: Workload, limit_check: bool) -> tuple[Binding, ...] | None:
        """A workload holding a reservation may use the GPUs it holds; placed, it gives the
        reservation up."""
        self.unhold(w.id)
        res = self.reserved.pop(w.id)
        placed = self.try_place(w, limit_check=limit_check)
        if placed is None:
            self.reserved[w.id] = res
            self.rehold(w.id)
        return placed

    def admit(
        self,
        w: Workload,
        bindings: tuple[Binding, ...],
        phase: str,
        victims: tuple[str, ...] = (),
    ) -> None:
        """`w` takes `bindings` now, or once the last of its victims has stopped."""
        by_model = self.models_of(bindings)
        for m, milli in by_model.items():
            self._add(w.tenant, m, milli)
        start = max(
            (ev.deadline for ev in self.result.evictions if ev.workload in victims),
            default=self.now,
        )
        self.result.admissions.append(
            Admission(w.id, bindings, start, self.borrowed(w.tenant, by_model), phase, victims)
        )
        self.done.add(w.id)
        if self.walk is not None:
            self.walk.rekey(w.tenant)

    # eviction ------------------------------------------------------------------------------

    def evictable(self, v: Workload) -> bool:
        if v.id in self.evicted or v.started_at is None or v.started_at > self.now:
            return False  # not running (yet)
        if self.s.prio(v).preemptible:
            return True
        if self.now - v.started_at < self.cfg.min_runtime:
            return False
        return v.preempted_at is None or self.now - v.preempted_at >= self.cfg.cooldown

    def victims_for(self, w: Workload, *, mode: str) -> list[Workload] | None:
        """Evict the cheapest set of running workloads that lets `w` fit, or return None with
        nothing changed. Never a victim of a higher priority than `w`. Modes:

        - reclaim: `w` is within its tenant's guarantee; victims are other tenants' borrowed
          work (their tenant stays above its guarantee before each eviction);
        - fair-share: victims are other tenants' work whose tenant, after the eviction, still
          has a larger share than `w`'s tenant after admitting it (so the move cannot flip
          back);
        - priority: victims of a strictly lower priority (or a preemptible class)."""
        reclaim = mode != "priority"
        mine = self.s.prio(w)
        q = self.s.quota(w.tenant)
        models = self.s.engine.allowed_models(w.request.shape, w.request.tier)
        model_names = {self.snap.model_names[m] for m in models}
        if mode == "reclaim":
            # Only within its guarantee on some model it may use.
            if not any(self.used(w.tenant, m) + w.gpu_milli <= q.guarantee(m) for m in model_names):
                return None
        hw = 1 - self.cfg.history_weight
        mine_after = self.share(w.tenant) + max(
            hw * w.gpu_milli / (self.s.capacity[m] * max(q.weight, 1e-9)) for m in model_names
        )
        shares: dict[str, float] = {}

        def lender_ok(v: Workload, allocs: list[tuple[str, int]], taken: dict) -> bool:
            if mode == "priority" and (v.tenant == w.tenant or self.cfg.priority_across_tenants):
                return True
            vq = self.s.quota(v.tenant)
            if mode == "reclaim":
                return any(
                    self.used(v.tenant, m) - taken.get((v.tenant, m), 0) > vq.guarantee(m)
                    for m, _ in allocs
                )
            if v.tenant not in shares:
                shares[v.tenant] = self.share(v.tenant)
            gone = sum(
                hw
                * (taken.get((v.tenant, m), 0) + milli)
                / (self.s.capacity[m] * max(vq.weight, 1e-9))
                for m, milli in allocs
            )
            return shares[v.tenant] - gone > mine_after

        cands: list[tuple[tuple, Workload, list[tuple[str, int]]]] = []
        for v in self.running.values():
            if v.tenant == w.tenant and reclaim:
                continue
            if not self.evictable(v):
                continue
            pv = self.s.prio(v)
            if reclaim:
                if pv.value > mine.value:
                    continue
            elif not (pv.value < mine.value or (pv.preemptible and not mine.preemptible)):
                continue

            allocs = [x for x in self._charge(v) if x[0] in model_names]
            if not allocs:
                continue
            assert v.started_at is not None
            # Least work lost first (none when it can checkpoint before it stops), then the
            # freshest checkpoint.
            lost = self.eviction_cost(v)
            cands.append(((pv.value, lost, v.lost_gpu_seconds(self.now), -v.started_at), v, allocs))
        fkey = self._cache_key(w)
        tenant_bound = reclaim or not self.cfg.priority_across_tenants
        vkey = (fkey, mode, w.tenant if tenant_bound else None, mine.value)
        if not cands or (fkey is not None and vkey in self.victim_fail):
            return None
        cands.sort(key=lambda c: c[0])
        need = w.request.shape.gpus * w.request.replicas
        if w.request.replicas == 1 and need:
            local = self._node_local(need, cands, set(models), lender_ok)
            if local is None:
                if fkey is not None:
                    self.victim_fail.add(vkey)
                return None
            cands = local
        mark = self.plan.checkpoint()
        chosen: list[Workload] = []
        placed = None
        over: dict[tuple[str, str], int] = {}
        for _, v, allocs in cands:
            if not lender_ok(v, allocs, over):
                continue
            for m, milli in allocs:
                over[(v.tenant, m)] = over.get((v.tenant, m), 0) + milli
            for aid in v.alloc_ids:
                self.snap.release(aid)
            chosen.append(v)
            if len(chosen) > self.cfg.max_victims:
                break
            if need and self.free_whole(models) < need:
                continue
            inner = self.plan.checkpoint()
            outcome = self.s.engine.place_one(w.request, self.plan)
            self.plan.rollback(inner)
            if outcome.placed:
                placed = chosen
                break
        self.plan.rollback(mark)
        if placed is None:
            if fkey is not None:
                self.victim_fail.add(vkey)
            return None
        # Drop victims that turn out not to be needed (the most expensive first).
        keep = list(placed)
        for v in sorted(placed, key=lambda x: -x.lost_gpu_seconds(self.now)):
            trial = [x for x in keep if x is not v]
            m2 = self.plan.checkpoint()
            for x in trial:
                for aid in x.alloc_ids:
                    self.snap.release(aid)
            ok = self.s.engine.place_one(w.request, self.plan).placed
            self.plan.rollback(m2)
            if ok:
                keep = trial
        for v in keep:
            for aid in v.alloc_ids:
                self.snap.release(aid)
        self.evict(keep, mode, w)
        return keep

    def eviction_cost(self, v: Workload) -> float:
        """GPU-seconds lost if `v` is evicted now: none if it can checkpoint within its grace
        period, else its work since the last checkpoint."""
        if v.checkpoint_cost <= self.grace(v):
            return 0.0
        return v.lost_gpu_seconds(self.now)

    def grace(self, v: Workload) -> float:
        """How long victim `v` may run on: the grace period, extended up to `checkpoint_wait`
        when that lets it write its checkpoint."""
        cost = v.checkpoint_cost
        if cost <= self.cfg.grace_period or cost > self.cfg.checkpoint_wait:
            return self.cfg.grace_period
        return cost

    def evict(self, victims: list[Workload], reason: str, w: Workload) -> None:
        """Record the eviction of `victims` (whose allocations the caller has released) in
        favour of `w`: usage moves off their tenants and they stop after their grace period."""
        for v in victims:
            for m, milli in self._charge(v):
                self._add(v.tenant, m, -milli)
            self.evicted.add(v.id)
            wait = self.grace(v)
            self.result.evictions.append(
                Eviction(v.id, reason, w.id, self.now + wait, self.eviction_cost(v))
            )
            del self.running[v.id]
        # Capacity grew: earlier failures no longer say anything.
        self.fail_cache.clear()
        self.fail_unheld.clear()
        self.victim_fail.clear()

    def _node_local(self, need: int, cands: list, models: set[int], lender_ok) -> list | None:
        """For a one-node shape: the node where the cheapest victims free `need` GPUs (lowest
        priority, then least lost work, then fewest victims); its victims, cheapest first."""
        snap = self.snap
        per_node: dict[int, list] = {}
        for c in cands:
            for n in {snap.allocs[a].node for a in c[1].alloc_ids}:
                per_node.setdefault(n, []).append(c)
        best: tuple | None = None
        for n, lst in per_node.items():
            if int(snap.node_model[n]) not in models or not snap.node_open(n):
                continue
            free = len(snap._wslots[n])
            take: list = []
            over: dict[tuple[str, str], int] = {}
            for c in lst:
                if free >= need:
                    break
                v, allocs = c[1], c[2]
                if not lender_ok(v, allocs, over):
                    continue
                for m, milli in allocs:
                    over[(v.tenant, m)] = over.get((v.tenant, m), 0) + milli
                free += sum(
                    len(snap.allocs[a].slots) for a in v.alloc_ids if snap.allocs[a].node == n
                )
                take.append(c)
            if free < need or not take:
                continue
            key = (
                max(c[0][0] for c in take),
                sum(c[0][1] for c in take),
                sum(c[0][2] for c in take),
                len(take),
                n,
            )
            if best is None or key < best[0]:
                best = (key, take)
        return None if best is None else best[1]

    # reservations --------------------------------------------------------------------------

    def reservation_for(self, w: Workload) -> Reservation | None:
        """The earliest start of `w` from the declared maximum runtimes of what runs, and the
        GPUs it would take then. Running work holding GPUs of an earlier reservation is never
        counted as ending (those GPUs are promised)."""
        promised = {g for _, gpus in self.reserved.values() for g in gpus}
        snap = self.snap
        ends: list[tuple[float, list[int]]] = []
        for v in self.running.values():
            if v.started_at is None:
                continue
            aids = list(v.alloc_ids)
            if promised and any(
                (snap.allocs[a].node, s) in promised for a in aids for s in snap.allocs[a].slots
            ):
                continue
            ends.append((max(self.now, v.started_at + v.max_runtime), aids))
        for adm in self.result.admissions:
            ends.append(
                (adm.start_at + self._max_runtime(adm.workload), [b.alloc_id for b in adm.bindings])
            )
        ends.sort(key=lambda e: e[0])
        models = self.s.engine.allowed_models(w.request.shape, w.request.tier)
        need = w.request.shape.gpus * w.request.replicas
        bound = self._earliest_bound(w, ends, models)
        if bound == math.inf:
            return None
        mark = self.plan.checkpoint()
        found: Reservation | None = None
        try:
            i = 0
            # Nothing can start before the bound: release what ends before it in one go.
            while i < len(ends) and ends[i][0] < bound:
                for aid in ends[i][1]:
                    if aid in snap.allocs:
                        snap.release(aid)
                i += 1
            while i < len(ends):
                t = ends[i][0]
                while i < len(ends) and ends[i][0] <= t:
                    for aid in ends[i][1]:
                        if aid in snap.allocs:
                            snap.release(aid)
                    i += 1
                if need and self.free_whole(models) < need:
                    continue
                outcome = self.s.engine.place_one(w.request, self.plan)
                if outcome.placed:
                    gpus = tuple((b.node, g) for b in outcome.bindings for g in b.gpu_indices)
                    found = Reservation(w.id, t, gpus)
                    break
        finally:
            self.plan.rollback(mark)
        return found

    def _earliest_bound(self, w: Workload, ends: list[tuple[float, list[int]]], models) -> float:
        """A lower bound on when a whole-GPU `w` could start (`now` for other shapes), from when
        each GPU comes free: a GPU is free once every allocation on it has ended (never, for
        GPUs held beyond the declared ends), and a node hosts a replica per `gpus` free GPUs.
        Optimistic (ignores host resources, topology and MIG re-layout), so the exact search
        may start there; `inf` when not even that is ever enough."""
        per, reps = w.request.shape.gpus, w.request.replicas
        if not per:
            return self.now
        snap = self.snap
        end_of = {aid: t for t, aids in ends for aid in aids}
        gpu_end: dict[int, dict[int, float]] = {}
        for aid, a in snap.allocs.items():
            t = end_of.get(aid, math.inf)
            slots = gpu_end.setdefault(a.node, {})
            for s in a.slots:
                if t > slots.get(s, -math.inf):
                    slots[s] = t
        wanted = set(models)
        ngpu = snap.node_ngpu
        # Nodes nobody holds anything on host their replicas now.
        open_idle = snap.node_sched & np.isin(snap.node_model, list(wanted)) & (ngpu >= per)
        idle = [n for n in np.flatnonzero(open_idle).tolist() if n not in gpu_end]
        now_count = sum(int(ngpu[n]) // per for n in idle)
        if now_count >= reps:
            return self.now
        steps: list[float] = []
        for n, slots in gpu_end.items():
            if not open_idle[n]:
                continue
            times = sorted(slots.values())
            times = [self.now] * (int(ngpu[n]) - len(times)) + times
            steps.extend(times[k * per - 1] for k in range(1, int(ngpu[n]) // per + 1))
        need = reps - now_count
        if len(steps) < need:
            return math.inf
        return max(self.now, heapq.nsmallest(need, steps)[-1])

    def _max_runtime(self, wid: str) -> float:
        return self.by_id[wid].max_runtime

    def carry(self, previous: Mapping[str, Reservation]) -> None:
        """Hold again, on the same GPUs, the reservations of workloads still waiting (a
        reservation recomputed every cycle drifts later as other work fills its GPUs). One
        whose GPUs are no longer reachable is dropped; its workload gets a new one."""
        snap = self.snap
        end: dict[int, float] = {}
        for v in self.running.values():
            if v.started_at is not None:
                for aid in v.alloc_ids:
                    end[aid] = max(self.now, v.started_at + v.max_runtime)
        for wid, res in previous.items():
            w = self.by_id.get(wid)
            if w is None or len(self.reserved) >= self.cfg.max_reservations:
                continue
            start = self.now
            for node, g in res.gpus:
                n = snap.node_index.get(node)
                if n is None or not snap.node_sched[n]:
                    start = math.inf
                    break
                for aid in snap.holders.get(n * snap.max_gpus + g, ()):
                    start = max(start, end.get(aid, math.inf))
            if start < math.inf:
                self.hold(Reservation(wid, start, res.gpus))

    def hold(self, res: Reservation) -> None:
        """Keep the reservation's free GPUs out of reach for the rest of the cycle."""
        snap = self.snap
        gpus = frozenset((snap.node_index[n], g) for n, g in res.gpus)
        self.reserved[res.workload] = (res, gpus)
        self.phantoms[res.workload] = self._hold(gpus)

    def _hold(self, gpus: Iterable[tuple[int, int]]) -> list[int]:
        snap = self.snap
        tid = snap.tenant_id(RESERVATION_TENANT)
        by_node: dict[int, list[int]] = {}
        for n, g in gpus:
            if snap.is_whole_free(n, g):
                by_node.setdefault(n, []).append(g)
        return [
            snap.allocate(tid, Tier.DEDICATED, n, tuple(sorted(slots)))
            for n, slots in by_node.items()
        ]

    def unhold(self, wid: str | None = None) -> None:
        for key in [wid] if wid is not None else list(self.phantoms):
            for aid in self.phantoms.pop(key, ()):
                self.snap.release(aid)

    def rehold(self, wid: str | None = None) -> None:
        for key in [wid] if wid is not None else list(self.reserved):
            if key not in self.phantoms:
                self.phantoms[key] = self._hold(self.reserved[key][1])

    def finish(self) -> None:
        self.unhold()
        self.result.reconfigurations = list(self.plan.reconfigurations)
        self.result.reservations = [res for res, _ in self.reserved.values()]


# --- the queue walk -----------------------------------------------------------------------------


class _Walk:
    """The queue in the configured order. Fair share: a heap of tenants keyed by (priority of
    their head, starving head first, dominant share, head's arrival), re-keyed as they are
    served; within a tenant, priority then arrival."""

    def __init__(self, c: _Cycle):
        self.c = c
        cfg = c.cfg
        prio = c.s.prio
        starving = self.starving = c.starving
        items = [w for w in c.queue if w.id not in c.done]
        if cfg.order == "arrival":
            items.sort(key=_arrival)
            self.flat: list[Workload] | None = items[::-1]
            return
        if cfg.order == "priority":
            items.sort(key=lambda w: (-prio(w).value, not w.expedited, w.submitted_at, w.id))
            self.flat = items[::-1]
            return
        self.flat = None
        per: dict[str, list[Workload]] = {}
        for w in items:
            per.setdefault(w.tenant, []).append(w)
        self.per = {
            t: sorted(
                ws,
                key=lambda w: (
                    not starving(w),
                    -prio(w).value,
                    not w.expedited,
                    w.submitted_at,
                    w.id,
                ),
            )[::-1]
            for t, ws in per.items()
        }
        self.heap: list[tuple] = []
        self.version: dict[str, int] = {}
        for t in self.per:
            self._push(t)

    def _push(self, t: str) -> None:
        ws = self.per.get(t)
        while ws and ws[-1].id in self.c.done:
            ws.pop()
        if not ws:
            return
        head = ws[-1]
        v = self.version.get(t, 0) + 1
        self.version[t] = v
        key = (
            not self.starving(head),
            -self.c.s.prio(head).value if self.c.cfg.priority_across_tenants else 0,
            not head.expedited,
            self.c.share(t),
            head.submitted_at,
            t,
        )
        heapq.heappush(self.heap, (key, v, t))

    def rekey(self, tenant: str) -> None:
        if self.flat is None:
            self._push(tenant)

    def next(self) -> Workload | None:
        if self.flat is not None:
            while self.flat:
                w = self.flat.pop()
                if w.id not in self.c.done:
                    return w
            return None
        while self.heap:
            _, v, t = heapq.heappop(self.heap)
            if self.version.get(t) != v:
                continue
            ws = self.per[t]
            while ws and ws[-1].id in self.c.done:
                ws.pop()
            if not ws:
                continue
            w = ws.pop()
            self._push(t)
            return w
        return None


# --- phases -------------------------------------------------------------------------------------


def _reclaim(c: _Cycle) -> None:
    """Tenants within their guarantee take back capacity that others borrowed."""
    _take_back(c, "reclaim")


def _fair_share(c: _Cycle) -> None:
    """Tenants below their fair share take capacity from tenants above theirs (the donor
    stays above the taker after the move, so it cannot flip back)."""
    _take_back(c, "fair-share")


def _take_back(c: _Cycle, mode: str) -> None:
    tried: dict[str, int] = {}
    per: dict[str, list[Workload]] = {}
    for w in c.queue:
        per.setdefault(w.tenant, []).append(w)
    depth = c.cfg.reclaim_depth
    heads = [
        w
        for ws in per.values()
        for w in heapq.nsmallest(
            depth * 2, ws, key=lambda w: (-c.s.prio(w).value, not w.expedited, w.submitted_at)
        )
    ]
    share = {t: c.share(t) for t in per}
    order = sorted(
        heads,
        key=lambda w: (-c.s.prio(w).value, not w.expedited, share[w.tenant], w.submitted_at, w.id),
    )
    for w in order:
        if w.id in c.done or tried.get(w.tenant, 0) >= c.cfg.reclaim_depth:
            continue
        if mode == "reclaim":
            q = c.s.quota(w.tenant)
            models = w.request.shape.models or c.snap.model_names
            if not any(c.used(w.tenant, m) + w.gpu_milli <= q.guarantee(m) for m in models):
                continue
        if c.over_limit(w):
            continue
        tried[w.tenant] = tried.get(w.tenant, 0) + 1
        placed = c.try_place(w)
        if placed is not None:
            c.admit(w, placed, mode)
            continue
        victims = c.victims_for(w, mode=mode)
        if victims is None:
            continue
        placed = c.try_place(w)
        if placed is not None:  # None only if the model it landed on is over its limit
            c.admit(w, placed, mode, tuple(v.id for v in victims))


def _allocate(c: _Cycle) -> None:
    """Walk the queue in order and admit what fits under its tenant's limit. Work whose
    reservation has come due goes first: its GPUs are free and held for it."""
    for wid, (res, _) in list(c.reserved.items()):
        owner = c.by_id[wid]
        if res.start_at <= c.now and not c.over_limit(owner):
            placed = c.try_place(owner)
            if placed is not None:
                c.admit(owner, placed, "allocate")
    c.walk = _Walk(c)
    while (w := c.walk.next()) is not None:
        if c.known_to_fail(w) and c.cfg.on_blocked == "skip":
            c.result.blocked[w.id] = "no capacity"
            continue
        if over := c.over_limit(w):
            c.result.blocked[w.id] = over
            continue
        placed = c.try_place(w)
        if placed is not None:
            c.admit(w, placed, "allocate")
            continue
        c.result.blocked[w.id] = "no capacity"
        if c.cfg.on_blocked == "skip":
            continue
        c.blocked.append(w)
        return  # stop, or reserve: the backfill phase carries on from here
    c.walk = None


def _preempt(c: _Cycle) -> None:
    """Blocked workloads evict strictly lower priorities, the least lost work first."""
    for w in list(c.blocked):
        if c.over_limit(w):
            continue
        victims = c.victims_for(w, mode="priority")
        if victims is None:
            continue
        placed = c.try_place(w)
        if placed is None:
            continue
        c.blocked.remove(w)
        c.result.blocked.pop(w.id, None)
        c.admit(w, placed, "preempt", tuple(v.id for v in victims))


def _backfill(c: _Cycle) -> None:
    """Reserve for the blocked head, then admit only what cannot delay the reservation."""
    if c.cfg.on_blocked != "reserve" or c.walk is None:
        return
    pending = [w for w in c.blocked if w.id not in c.done]
    walk = c.walk

    tries = 0
    reserved_for = {c.by_id[wid].tenant for wid in c.reserved}

    def reserve(w: Workload) -> None:
        nonlocal tries
        if len(c.reserved) >= c.cfg.max_reservations or tries > c.cfg.max_reservations:
            return
        if w.id in c.reserved or w.tenant in reserved_for:
            return  # one per tenant: its head is the one that waits
        reserved_for.add(w.tenant)
        tries += 1
        res = c.reservation_for(w)
        if res is not None:
            c.hold(res)
            c.result.blocked[w.id] = f"reserved from t={res.start_at:.0f}"

    for head in pending:
        reserve(head)
    examined = 0
    while (w := walk.next()) is not None:
        examined += 1
        if examined > c.cfg.backfill_depth:
            break
        short = bool(c.reserved) and c.now + w.max_runtime <= min(
            r.start_at for r, _ in c.reserved.values()
        )
        if c.known_to_fail(w) and not short:
            c.result.blocked[w.id] = "no capacity"
            reserve(w)
            continue
        if over := c.over_limit(w):
            c.result.blocked[w.id] = over
            continue
        placed = c.try_place(w)
        if placed is None and short:
            # Ends before any reservation starts: it may use reserved GPUs.
            saved, c.fail_cache = c.fail_cache, c.fail_unheld
            if not c.known_to_fail(w):
                c.unhold()
                placed = c.try_place(w)
                c.rehold()
            c.fail_cache = saved
        if placed is not None:
            c.admit(w, placed, "backfill")
            continue
        c.result.blocked[w.id] = "no capacity"
        reserve(w)
    c.walk = None


def _defragment(c: _Cycle) -> None:
    """Multi-GPU work waits while the free GPUs are scattered over many nodes: move the small
    work off the nodes closest to free, so the waiting work gets whole nodes now. A workload is
    moved (evicted) only when it can write its checkpoint within its grace period (so a move
    loses no work) and fits in the free GPUs elsewhere at once. Those GPUs are kept out of this
    phase's reach; when it is queued again it asks for GPUs like any other workload. Never moves
    a higher priority than the work it makes room for, nor work that the minimum runtime or the
    cool-down protect."""
    cfg, snap = c.cfg, c.snap
    if cfg.defragment_per_cycle <= 0 or not c.running:
        return
    waiting = [
        w
        for w in c.queue
        if w.id not in c.done
        and w.request.shape.unit is Unit.WHOLE
        and w.request.shape.gpus >= 2
        and not c.over_limit(w)
    ]
    if not waiting:
        return
    waiting.sort(
        key=lambda w: (-c.s.prio(w).value, not w.expedited, c.share(w.tenant), w.submitted_at, w.id)
    )
    # Only one-replica work ever moves (`_movable`): a gang's thousands of allocations need no
    # entry.
    owner: dict[int, Workload] = {
        aid: v for v in c.running.values() if v.request.replicas == 1 for aid in v.alloc_ids
    }
    landing: list[int] = []
    moves = 0
    failed: set[tuple] = set()  # (shape, priority, tenant) found no plan: capacity only shrinks
    try:
        for w in waiting[: cfg.defragment_depth]:
            if moves >= cfg.defragment_per_cycle:
                break
            key = (c._cache_key(w), c.s.prio(w).value, w.tenant)
            if key[0] is not None and key in failed:
                continue
            # A reservation's GPUs are its owner's: free them for its search.
            reservation = c.reserved.get(w.id)
            if reservation is not None:
                c.unhold(w.id)
            victims = _clear_nodes(c, w, owner)
            placed = None
            if victims is not None:
                mark = c.plan.checkpoint()
                for v in victims:
                    for aid in v.alloc_ids:
                        snap.release(aid)
                saved, c.fail_cache = c.fail_cache, set()
                placed = c.try_place(w)  # gives its reservation up when placed
                c.fail_cache = saved
                landed: list[int] = []
                for v in victims if placed is not None else ():
                    out = c.s.engine.place_one(v.request, c.plan)
                    if not out.placed:
                        placed = None
                        break
                    landed += [b.alloc_id for b in out.bindings]
                if placed is None:
                    c.plan.rollback(mark)
            if placed is None or victims is None:
                failed.add(key)
                if reservation is not None:  # any hold since the unhold was rolled back
                    c.phantoms.pop(w.id, None)
                    c.reserved[w.id] = reservation
                    c.rehold(w.id)
                continue
            landing += landed
            for v in victims:
                for aid in v.alloc_ids:
                    owner.pop(aid, None)
            c.evict(victims, "defragment", w)
            c.admit(w, placed, "defragment", tuple(v.id for v in victims))
            moves += 1
    finally:
        for aid in landing:  # the moved work asks for GPUs again once it is queued
            snap.release(aid)


def _clear_nodes(c: _Cycle, w: Workload, owner: Mapping[int, Workload]) -> list[Workload] | None:
    """The cheapest small work to move so that `w`'s replicas find nodes: per node, the movable
    workloads (one node, whole GPUs, evictable, priority not above `w`'s) that free enough GPUs
    at the least lost work; then the cheapest nodes. None when no such plan exists or the free
    GPUs elsewhere could not take what moves."""
    snap, cfg = c.snap, c.cfg
    per, reps = w.request.shape.gpus, w.request.replicas
    models = set(c.s.engine.allowed_models(w.request.shape, w.request.tier))
    free_total = c.free_whole(models)
    if free_total < per * reps:
        return None
    mine = c.s.prio(w).value
    budget = int(cfg.defragment_max_moved * per)
    # Candidates come from the index of open nodes by whole free GPUs: those missing at most
    # `budget` GPUs (at least one free, as the budget is below `per`).
    fits_now = sum(
        (k // per) * len(nodes) for (m, k), nodes in snap.whole.items() if m in models and k >= per
    )
    candidates = [
        (n, k)
        for (m, k), nodes in snap.whole.items()
        if m in models and per - budget <= k < per
        for n in nodes
        if int(snap.node_ngpu[n]) >= per
    ]
    options: list[tuple[float, int, int, int, list[Workload]]] = []
    for n, free in candidates:
        movable: list[tuple[float, int, Workload]] = []
        seen: set[str] = set()
        base = n * snap.max_gpus
        for g in range(int(snap.node_ngpu[n])):
            for aid in snap.holders.get(base + g, ()):
                v = owner.get(aid)
                if v is None or v.id in seen:
                    continue
                seen.add(v.id)
                if _movable(c, v, n, mine):
                    gpus = sum(len(snap.allocs[a].slots) for a in v.alloc_ids)
                    # A move costs the time it spends writing its checkpoint.
                    movable.append((v.checkpoint_cost * gpus, gpus, v))
        movable.sort(key=lambda x: (x[0], -x[1], x[2].id))
        take: list[Workload] = []
        moved, cost = 0, 0.0
        for cost_v, gpus, v in movable:
            if free >= per:
                break
            take.append(v)
            free += gpus
            moved += gpus
            cost += cost_v
        if free >= per and moved <= budget:
            options.append((cost, moved, n, free - moved, take))
    short = reps - fits_now
    if short <= 0 or len(options) < short:
        return None
    chosen = heapq.nsmallest(short, options, key=lambda o: o[:3])
    # What moves must fit in the free GPUs that `w` does not take.
    elsewhere = free_total - sum(o[3] for o in chosen) - (reps - short) * per
    if elsewhere < sum(o[1] for o in chosen):
        return None
    return [v for o in chosen for v in o[4]]


def _movable(c: _Cycle, v: Workload, n: int, mine: int) -> bool:
    if v.id in c.evicted or not c.evictable(v) or c.s.prio(v).value > mine:
        return False
    if c.eviction_cost(v) > 0:  # its checkpoint outlasts the wait: a move would lose work
        return False
    r = v.request
    if r.replicas != 1 or r.shape.unit is not Unit.WHOLE:
        return False
    return all(c.snap.allocs[a].node == n for a in v.alloc_ids)


def water_fill(capacity: float, demand: Mapping[str, float], weight: Mapping[str, float]) -> dict:
    """Weighted max-min fair split of `capacity` over tenants, each capped at its demand."""
    out = {t: 0.0 for t in demand}
    active = {t for t in demand if demand[t] > 0}
    left = capacity
    while active and left > 1e-9:
        wsum = sum(weight[t] for t in active)
        step = {t: left * weight[t] / wsum for t in active}
        capped = {t for t in active if out[t] + step[t] >= demand[t]}
        if not capped:
            for t in active:
                out[t] += step[t]
            break
        for t in capped:
            left -= demand[t] - out[t]
            out[t] = demand[t]
        active -= capped
    return out


def _arrival(w: Workload) -> tuple[float, str]:
    return (w.submitted_at, w.id)


def _milli(a) -> int:
    if a.mig is not None:
        return PROFILES[a.mig].gpu_equivalent_milli
    return a.milli or 1000 * len(a.slots)


PHASES: dict[str, Callable[[_Cycle], None]] = {
    "reclaim": _reclaim,
    "fair-share": _fair_share,
    "allocate": _allocate,
    "preempt": _preempt,
    "backfill": _backfill,
    "defragment": _defragment,
}

BASELINES: dict[str, QueueConfig] = {
    # What a default Kubernetes scheduler does: arrival order, first fit, no preemption.
    "fifo": QueueConfig(
        phases=("allocate",), order="arrival", on_blocked="skip", placement_policy="first-fit"
    ),
    # Strict priority: the head blocks everything behind it; it may evict lower priorities.
    "priority": QueueConfig(phases=("allocate", "preempt"), order="priority", on_blocked="stop"),
    "default": QueueConfig(),
    # Shares before speed: across tenants the fair share orders the queue (priority only within
    # a tenant), and no tenant starts work beyond 1.1x its fair share while others wait.
    "strict-share": QueueConfig(share_cap=1.1, priority_across_tenants=False),
}
