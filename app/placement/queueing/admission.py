"""Admission: quotas and fair share (each tenant's dominant share, its limit, and under
`share_cap` its fair-share ceiling), placing and admitting a workload, the queue walk in the
configured order, and the allocate phase that walks it."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from app.placement.engine import Plan
from app.placement.model import Binding
from app.placement.queueing.decisions import Admission, Workload
from app.placement.queueing.fairshare import water_fill
from app.placement.queueing.state import _CycleState, _SchedulerView


class _Admitting(_CycleState):
    """The cycle with quotas, fair share, and placing and admitting work."""

    def __init__(
        self,
        sched: _SchedulerView,
        now: float,
        pending: list[Workload],
        running: list[Workload],
        plan: Plan | None = None,
    ):
        super().__init__(sched, now, pending, running, plan)
        # (tenant, model) -> GPU milli above which the tenant starts nothing more (share_cap).
        self.fair_caps = self._fair_caps() if self.cfg.share_cap is not None else {}
        self.walk: _Walk | None = None

    # quotas and fair share -----------------------------------------------------------------

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


# --- the queue walk -----------------------------------------------------------------------------


class _Walk:
    """The queue in the configured order. Fair share: a heap of tenants keyed by (priority of
    their head, starving head first, dominant share, head's arrival), re-keyed as they are
    served; within a tenant, priority then arrival."""

    def __init__(self, c: _Admitting):
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


# --- the allocate phase -------------------------------------------------------------------------


def _allocate(c: _Admitting) -> None:
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


def _arrival(w: Workload) -> tuple[float, str]:
    return (w.submitted_at, w.id)
