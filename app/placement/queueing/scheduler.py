"""The cycle driver: the `Scheduler` runs the configured phases in order over one `_Cycle` (the
same snapshot and undo log), and answers what-ifs on a plan it rolls back. The top of the
package: it imports every phase."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from app.placement.engine import Engine, Plan
from app.placement.policies import make_policy
from app.placement.queueing.admission import _allocate
from app.placement.queueing.backfill import _backfill
from app.placement.queueing.config import PHASE_NAMES, PriorityClass, QueueConfig, TenantQuota
from app.placement.queueing.cycle import _Cycle
from app.placement.queueing.decisions import CycleResult, Reservation, WhatIf, Workload
from app.placement.queueing.defragment import _defragment
from app.placement.queueing.fairshare import UsageHistory
from app.placement.queueing.preemption import _fair_share, _preempt, _reclaim
from app.placement.snapshot import Snapshot


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
        self,
        workload: Workload,
        now: float,
        pending: list[Workload],
        running: list[Workload],
        replacing: str | None = None,
    ) -> WhatIf:
        """The decision for `workload` if it were at the head of its queue now; changes nothing.
        `replacing`: the id of a running workload `workload` would take the place of (an
        elastic gang at its full size): its GPUs count as free."""
        plan = Plan(self.snap)
        mark = plan.checkpoint()
        try:
            if replacing is not None:
                for r in running:
                    if r.id == replacing:
                        for aid in r.alloc_ids:
                            self.snap.release(aid)
                running = [r for r in running if r.id != replacing]
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


PHASES: dict[str, Callable[[_Cycle], None]] = {
    "reclaim": _reclaim,
    "fair-share": _fair_share,
    "allocate": _allocate,
    "preempt": _preempt,
    "backfill": _backfill,
    "defragment": _defragment,
}
# QueueConfig.validate (config.py, below this module) checks phases against the names.
assert tuple(PHASES) == PHASE_NAMES
