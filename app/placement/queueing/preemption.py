"""Preemption and victim choice: which running work may be evicted (minimum runtime,
cool-down, priority, the lending tenant's guarantee or share), the cheapest set of victims
that lets a workload fit, and the phases that evict: reclaim and fair-share (taking back
capacity lent to other tenants) and preempt (for priority)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from app.placement.queueing.admission import _Admitting
from app.placement.queueing.config import PriorityClass, TenantQuota
from app.placement.queueing.decisions import Eviction, Workload

# A victim with its sort key, and its (model, GPU milli) on the models the workload may use.
_Candidate = tuple[tuple, Workload, list[tuple[str, int]]]
# lender_ok(victim, its allocations there, taken so far per (tenant, model)).
_LenderCheck = Callable[[Workload, list[tuple[str, int]], dict], bool]


class _Evicting(_Admitting):
    """The cycle with victim choice and eviction."""

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
        lender_ok = self._lender_check(w, mode, q, model_names)
        cands = self._victim_candidates(w, mine, reclaim, model_names)
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
        placed = self._victims_until_fit(w, cands, models, need, lender_ok)
        if placed is None:
            if fkey is not None:
                self.victim_fail.add(vkey)
            return None
        keep = self._needed_victims(w, placed)
        for v in keep:
            for aid in v.alloc_ids:
                self.snap.release(aid)
        self.evict(keep, mode, w)
        return keep

    def _lender_check(
        self, w: Workload, mode: str, q: TenantQuota, model_names: set[str]
    ) -> _LenderCheck:
        """Whether a victim's tenant may lend for `w` under `mode`: `lender_ok(v, allocs, taken)`
        with `allocs` what evicting `v` frees on `w`'s models and `taken` what the victims
        chosen before it already took, per (tenant, model)."""
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

        return lender_ok

    def _victim_candidates(
        self, w: Workload, mine: PriorityClass, reclaim: bool, model_names: set[str]
    ) -> list[_Candidate]:
        """Running work `w` may evict, with its sort key and what it holds on `w`'s models."""
        cands: list[_Candidate] = []
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
        return cands

    def _victims_until_fit(
        self,
        w: Workload,
        cands: list[_Candidate],
        models: list[int],
        need: int,
        lender_ok: _LenderCheck,
    ) -> list[Workload] | None:
        """Release candidates in order (within a checkpoint, rolled back) until `w` fits: the
        victims, or None when it never does."""
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
        return placed

    def _needed_victims(self, w: Workload, placed: list[Workload]) -> list[Workload]:
        """Drop victims that turn out not to be needed (the most expensive first)."""
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


# --- the phases that evict ----------------------------------------------------------------------


def _reclaim(c: _Evicting) -> None:
    """Tenants within their guarantee take back capacity that others borrowed."""
    _take_back(c, "reclaim")


def _fair_share(c: _Evicting) -> None:
    """Tenants below their fair share take capacity from tenants above theirs (the donor
    stays above the taker after the move, so it cannot flip back)."""
    _take_back(c, "fair-share")


def _take_back(c: _Evicting, mode: str) -> None:
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


def _preempt(c: _Evicting) -> None:
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
