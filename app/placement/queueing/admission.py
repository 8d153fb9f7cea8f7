"""Admission, as functions of the cycle's state: quotas and fair share (each tenant's dominant
share, its limit, and under `share_cap` its fair-share ceiling), placing and admitting a
workload, the queue walk in the configured order, and the allocate phase that walks it."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from functools import partial

from app.placement.model import Binding
from app.placement.queueing.decisions import Admission, Workload
from app.placement.queueing.fairshare import water_fill
from app.placement.queueing.state import CycleState

# --- quotas and fair share -----------------------------------------------------------------------


def share(c: CycleState, tenant: str) -> float:
    """Dominant share over GPU models of current and decayed use, divided by the weight."""
    cached = c.shares.get(tenant)
    if cached is None:
        cached = c.shares[tenant] = _share(c, tenant)
    return cached


def _share(c: CycleState, tenant: str) -> float:
    cfg, hist = c.cfg, c.s.history
    best = 0.0
    per = c.usage.get(tenant, {})
    models = set(per) | {m for (t, m) in hist.decayed if t == tenant}
    for m in models:
        cap = c.s.capacity.get(m)
        if not cap:
            continue
        eff = (1 - cfg.history_weight) * per.get(m, 0) + cfg.history_weight * hist.average(
            (tenant, m)
        )
        best = max(best, eff / cap)
    return best / max(c.s.quota(tenant).weight, 1e-9)


def starving(c: CycleState, w: Workload) -> bool:
    return c.now - w.submitted_at >= c.cfg.starvation_factor * w.max_runtime


def fair_caps(c: CycleState) -> dict[tuple[str, str], float]:
    """Per (tenant, GPU model) with work waiting: share_cap times the tenant's weighted
    max-min fair share of what tenants without waiting work leave of the model (demand: use
    plus waiting work, which counts on every model it allows), never below its guarantee."""
    assert c.cfg.share_cap is not None
    snap, engine = c.snap, c.s.engine
    waiting: dict[str, dict[str, int]] = {}
    for w in c.queue:
        req = w.request
        per = waiting.setdefault(w.tenant, {})
        for m in engine.allowed_models(req.shape, req.tier):
            name = snap.model_names[m]
            per[name] = per.get(name, 0) + w.gpu_milli
    caps: dict[tuple[str, str], float] = {}
    for model, capacity in c.s.capacity.items():
        demand = {t: c.used(t, model) + per[model] for t, per in waiting.items() if model in per}
        if len(demand) < 2:
            continue  # alone, its fair share is all that is left
        left = capacity - sum(per.get(model, 0) for t, per in c.usage.items() if t not in demand)
        weights = {t: max(c.s.quota(t).weight, 1e-9) for t in demand}
        for t, fair in water_fill(left, demand, weights).items():
            caps[(t, model)] = max(c.s.quota(t).guarantee(model), c.cfg.share_cap * fair)
    return caps


def over_limit(c: CycleState, w: Workload, by_model: Mapping[str, int] | None = None) -> str | None:
    """Why admitting `w` (charged as `by_model`, default: each allowed model) would exceed
    its tenant's limit or, under `share_cap`, its fair share; None if it would not."""
    q = c.s.quota(w.tenant)
    if not q.limit and not c.fair_caps:
        return None
    if by_model is None:
        by_model = {m: w.gpu_milli for m in w.request.shape.models or c.snap.model_names}
        blocked = all  # it may go to any allowed model: blocked only if all are
    else:
        blocked = any

    def over(m: str) -> bool:
        cap = q.cap(m)
        return cap is not None and c.used(w.tenant, m) + by_model[m] > cap

    def at_share(m: str) -> bool:
        cap = c.fair_caps.get((w.tenant, m))
        return cap is not None and c.used(w.tenant, m) >= cap

    if q.limit and blocked(over(m) for m in by_model):
        return "over its tenant's limit"
    if c.fair_caps and blocked(at_share(m) for m in by_model):
        return "at its fair share while other tenants wait"
    return None


def borrowed(c: CycleState, tenant: str, by_model: Mapping[str, int]) -> bool:
    q = c.s.quota(tenant)
    return any(c.used(tenant, m) > q.guarantee(m) for m in by_model)


# --- placing and admitting -----------------------------------------------------------------------


def try_place(
    c: CycleState, w: Workload, *, limit_check: bool = True
) -> tuple[Binding, ...] | None:
    """Place `w` (recorded in the plan) or return None with nothing changed. Failures of
    whole-GPU shapes are remembered for the cycle (capacity only shrinks within a walk)."""
    if w.id in c.reserved:
        return _place_owner(c, w, limit_check)
    req = w.request
    key = c.fit_key(w)
    if key is not None:
        if key in c.fail_cache:
            return None
        models = c.s.engine.allowed_models(req.shape, req.tier)
        if c.free_whole(models) < req.shape.gpus * req.replicas:
            c.fail_cache.add(key)
            return None
    mark = c.plan.checkpoint()
    outcome = c.s.engine.place_one(req, c.plan)
    if not outcome.placed:
        c.plan.rollback(mark)
        if key is not None:
            c.fail_cache.add(key)
        return None
    if limit_check and over_limit(c, w, c.models_of(outcome.bindings)):
        c.plan.rollback(mark)
        return None
    c.plan.outcomes.append(outcome)
    return tuple(outcome.bindings)


def _place_owner(c: CycleState, w: Workload, limit_check: bool) -> tuple[Binding, ...] | None:
    """A workload holding a reservation may use the GPUs it holds; placed, it gives the
    reservation up."""
    c.unhold(w.id)
    res = c.reserved.pop(w.id)
    placed = try_place(c, w, limit_check=limit_check)
    if placed is None:
        c.reserved[w.id] = res
        c.rehold(w.id)
    return placed


def admit(
    c: CycleState,
    w: Workload,
    bindings: tuple[Binding, ...],
    phase: str,
    victims: tuple[str, ...] = (),
) -> None:
    """`w` takes `bindings` now, or once the last of its victims has stopped."""
    by_model = c.models_of(bindings)
    for m, milli in by_model.items():
        c.add_usage(w.tenant, m, milli)
    start = max(
        (ev.deadline for ev in c.result.evictions if ev.workload in victims),
        default=c.now,
    )
    c.result.admissions.append(
        Admission(w.id, bindings, start, borrowed(c, w.tenant, by_model), phase, victims)
    )
    c.done.add(w.id)
    if c.walk is not None:
        c.walk.rekey(w.tenant)


# --- the queue walk ------------------------------------------------------------------------------


class Walk:
    """The queue in the configured order. Fair share: a heap of tenants keyed by (priority of
    their head, starving head first, dominant share, head's arrival), re-keyed as they are
    served; within a tenant, priority then arrival."""

    def __init__(self, c: CycleState):
        self.c = c
        cfg = c.cfg
        prio = c.s.prio
        self.starving = starving_now = partial(starving, c)
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
                    not starving_now(w),
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
            share(self.c, t),
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


# --- the allocate phase --------------------------------------------------------------------------


def allocate(c: CycleState) -> None:
    """Walk the queue in order and admit what fits under its tenant's limit. Work whose
    reservation has come due goes first: its GPUs are free and held for it."""
    for wid, (res, _) in list(c.reserved.items()):
        owner = c.by_id[wid]
        if res.start_at <= c.now and not over_limit(c, owner):
            placed = try_place(c, owner)
            if placed is not None:
                admit(c, owner, placed, "allocate")
    c.walk = Walk(c)
    while (w := c.walk.next()) is not None:
        if c.known_to_fail(w) and c.cfg.on_blocked == "skip":
            c.result.blocked[w.id] = "no capacity"
            continue
        if over := over_limit(c, w):
            c.result.blocked[w.id] = over
            continue
        placed = try_place(c, w)
        if placed is not None:
            admit(c, w, placed, "allocate")
            continue
        c.result.blocked[w.id] = "no capacity"
        if c.cfg.on_blocked == "skip":
            continue
        c.blocked.append(w)
        return  # stop, or reserve: the backfill phase carries on from here
    c.walk = None


def _arrival(w: Workload) -> tuple[float, str]:
    return (w.submitted_at, w.id)
