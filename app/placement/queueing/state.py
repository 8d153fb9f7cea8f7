"""The state one scheduling cycle's phases share, and its plumbing: the snapshot and its undo
log (the plan), usage per tenant and GPU model as allocations come and go, the failure caches,
and the placeholder allocations that hold reserved GPUs.

`CycleState` is passed, explicitly, to every operation and phase above it (as Armada's
scheduling context is): admission.py (quotas, fair share, placing and admitting), preemption.py
(victims), backfill.py (reservations) and defragment.py are functions of it; none inherits it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from app.placement.engine import Engine, Plan
from app.placement.isolation import Tier
from app.placement.mig import PROFILES
from app.placement.model import Binding
from app.placement.queueing.config import PriorityClass, QueueConfig, TenantQuota
from app.placement.queueing.decisions import CycleResult, Reservation, Workload
from app.placement.queueing.fairshare import UsageHistory
from app.placement.snapshot import Snapshot

RESERVATION_TENANT = "__reservation__"


class SchedulerView(Protocol):
    """What a cycle reads of the scheduler that runs it (scheduler.Scheduler)."""

    config: QueueConfig
    snap: Snapshot
    engine: Engine
    history: UsageHistory
    capacity: dict[str, int]

    def quota(self, tenant: str) -> TenantQuota: ...

    def prio(self, w: Workload) -> PriorityClass: ...


class QueueWalk(Protocol):
    """The queue in its configured order, as one phase leaves it for the next (admission.Walk)."""

    def next(self) -> Workload | None:
        """The next workload not yet admitted or given up, or None at the end."""
        ...

    def rekey(self, tenant: str) -> None:
        """`tenant`'s usage changed: its place in the order may too."""
        ...


class CycleState:
    """What every phase of one cycle reads and changes, with the plumbing under every layer:
    usage accounting, free capacity and the failure caches, reserved GPUs held."""

    def __init__(
        self,
        sched: SchedulerView,
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
            self.charge(w)
            for model, milli in w._charge[2]:  # type: ignore[index]
                self.add_usage(w.tenant, model, milli)
        # (tenant, model) -> GPU milli above which the tenant starts nothing more (share_cap):
        # admission.fair_caps fills it in when the cycle starts.
        self.fair_caps: dict[tuple[str, str], float] = {}
        # The walk the allocate phase stopped in, for the backfill phase to carry on.
        self.walk: QueueWalk | None = None
        self.blocked: list[Workload] = []
        # Reservations held in this cycle (by workload), and the placeholder allocations that
        # keep their free GPUs out of reach of everyone else.
        self.reserved: dict[str, tuple[Reservation, frozenset[tuple[int, int]]]] = {}
        self.phantoms: dict[str, list[int]] = {}
        self.fail_cache: set[tuple] = set()
        self.fail_unheld: set[tuple] = set()  # the same, ignoring reservations
        self.victim_fail: set[tuple] = set()  # (shape, kind, tenant, priority) found no victims

    # usage ---------------------------------------------------------------------------------

    def charge(self, w: Workload) -> list[tuple[str, int]]:
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

    def add_usage(self, tenant: str, model: str, milli: int) -> None:
        self.shares.pop(tenant, None)
        per = self.usage.setdefault(tenant, {})
        per[model] = per.get(model, 0) + milli

    def usage_by_key(self) -> dict[tuple[str, str], int]:
        return {(t, m): v for t, per in self.usage.items() for m, v in per.items()}

    def used(self, tenant: str, model: str) -> int:
        return self.usage.get(tenant, {}).get(model, 0)

    def models_of(self, bindings: Iterable[Binding]) -> dict[str, int]:
        snap, out = self.snap, dict[str, int]()
        for b in bindings:
            a = snap.allocs[b.alloc_id]
            model = snap.model_names[int(snap.node_model[a.node])]
            out[model] = out.get(model, 0) + _milli(a)
        return out

    # free capacity and the failure caches --------------------------------------------------

    def free_whole(self, models: Iterable[int]) -> int:
        whole = self.snap.whole
        wanted = set(models)
        return sum(k * len(b) for (m, k), b in whole.items() if m in wanted)

    @staticmethod
    def fit_key(w: Workload) -> tuple | None:
        """Whole-GPU shapes that fail once fail for the rest of the walk; () for other shapes.
        The software it needs is part of the shape: work that only some nodes may run (a
        runtime, a stack, a CUDA version) failing says nothing of work any node may run."""
        key = w._fit_key
        if key is None:
            r = w.request
            if not r.shape.gpus or r.shape.cpu_milli or r.shape.mem_mib:
                key = ()
            else:
                key = (r.tier, r.shape.gpus, r.replicas, r.shape.models, r.topology)
                key += (r.same_perf_class, r.avoid, r.runtime, r.stack, r.min_cuda)
            w._fit_key = key
        return key or None

    def known_to_fail(self, w: Workload) -> bool:
        key = self.fit_key(w)
        return key is not None and key in self.fail_cache

    # reserved GPUs held --------------------------------------------------------------------

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
        """The cycle's end: reserved GPUs let go, and what it planned put in its result."""
        self.unhold()
        self.result.reconfigurations = list(self.plan.reconfigurations)
        self.result.reservations = [res for res, _ in self.reserved.values()]


def _milli(a) -> int:
    if a.mig is not None:
        return PROFILES[a.mig].gpu_equivalent_milli
    return a.milli or 1000 * len(a.slots)
