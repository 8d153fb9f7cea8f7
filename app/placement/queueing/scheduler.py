"""The cycle driver: the `Scheduler` runs the configured phases in order over one `CycleState`
(the same snapshot and undo log), and answers what-ifs on a plan it rolls back. The top of the
package: it imports every phase."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from app.placement.engine import Engine, Plan
from app.placement.policies import make_policy
from app.placement.queueing.admission import allocate, fair_caps, over_limit, try_place
from app.placement.queueing.backfill import backfill, carry, reservation_for
from app.placement.queueing.config import PHASE_NAMES, PriorityClass, QueueConfig, TenantQuota
from app.placement.queueing.decisions import CycleResult, Reservation, WhatIf, Workload
from app.placement.queueing.defragment import defragment
from app.placement.queueing.fairshare import UsageHistory
from app.placement.queueing.preemption import fair_share, grace, preempt, reclaim, victims_for
from app.placement.queueing.state import CycleState
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
        c = self._start(now, pending, running)
        self.history.advance(now, c.usage_by_key())
        carry(c, self.reservations)
        for name in self.config.phases:
            PHASES[name](c)
        c.finish()
        self.reservations = {r.workload: r for r in c.result.reservations}
        return c.result

    def _start(
        self, now: float, pending: list[Workload], running: list[Workload], plan: Plan | None = None
    ) -> CycleState:
        c = CycleState(self, now, pending, running, plan)
        if self.config.share_cap is not None:
            c.fair_caps = fair_caps(c)
        return c

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
            c = self._start(now, pending, running, plan)
            carry(c, self.reservations)
            over = over_limit(c, workload)
            if over:
                return WhatIf(False, (), (), None, over)
            bindings = try_place(c, workload)
            if bindings is not None:
                return WhatIf(True, bindings, (), now, "fits now")
            for mode in ("reclaim", "priority"):
                victims = victims_for(c, workload, mode=mode)
                if victims is not None:
                    placed = try_place(c, workload)
                    assert placed is not None
                    start = max(now + grace(c, v) for v in victims)
                    return WhatIf(
                        True,
                        placed,
                        tuple(v.id for v in victims),
                        start,
                        "reclaims borrowed capacity"
                        if mode == "reclaim"
                        else "preempts lower priority",
                    )
            res = reservation_for(c, workload)
            if res is None:
                return WhatIf(False, (), (), None, "does not fit the fleet")
            return WhatIf(False, (), (), res.start_at, "waits for running work to end")
        finally:
            plan.rollback(mark)


PHASES: dict[str, Callable[[CycleState], None]] = {
    "reclaim": reclaim,
    "fair-share": fair_share,
    "allocate": allocate,
    "preempt": preempt,
    "backfill": backfill,
    "defragment": defragment,
}
# QueueConfig.validate (config.py, below this module) checks phases against the names.
assert tuple(PHASES) == PHASE_NAMES
