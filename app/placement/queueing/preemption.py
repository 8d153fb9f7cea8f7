"""Preemption and victim choice: which running work may be evicted (minimum runtime,
cool-down, priority, the lending tenant's guarantee or share), the cheapest set of victims
that lets a workload fit, and the phases that evict: reclaim and fair-share (taking back
capacity lent to other tenants) and preempt (for priority)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from app.placement.queueing.admission import admit, over_limit, share, try_place
from app.placement.queueing.config import PriorityClass, TenantQuota
from app.placement.queueing.decisions import Eviction, Workload
from app.placement.queueing.state import CycleState

# A victim with its sort key, and its (model, GPU milli) on the models the workload may use.
_Candidate = tuple[tuple, Workload, list[tuple[str, int]]]
# lender_ok(victim, its allocations there, taken so far per (tenant, model)).
_LenderCheck = Callable[[Workload, list[tuple[str, int]], dict], bool]


# --- eviction ------------------------------------------------------------------------------------


def evictable(c: CycleState, v: Workload) -> bool:
    if v.id in c.evicted or v.started_at is None or v.started_at > c.now:
        return False  # not running (yet)
    if c.s.prio(v).preemptible:
        return True
    if c.now - v.started_at < c.cfg.min_runtime:
        return False
    return v.preempted_at is None or c.now - v.preempted_at >= c.cfg.cooldown


def victims_for(c: CycleState, w: Workload, *, mode: str) -> list[Workload] | None:
    """Evict the cheapest set of running workloads that lets `w` fit, or return None with
    nothing changed. Never a victim of a higher priority than `w`. Modes:

    - reclaim: `w` is within its tenant's guarantee; victims are other tenants' borrowed
      work (their tenant stays above its guarantee before each eviction);
    - fair-share: victims are other tenants' work whose tenant, after the eviction, still
      has a larger share than `w`'s tenant after admitting it (so the move cannot flip
      back);
    - priority: victims of a strictly lower priority (or a preemptible class)."""
    reclaim = mode != "priority"
    mine = c.s.prio(w)
    q = c.s.quota(w.tenant)
    models = c.s.engine.allowed_models(w.request.shape, w.request.tier)
    model_names = {c.snap.model_names[m] for m in models}
    if mode == "reclaim":
        # Only within its guarantee on some model it may use.
        if not any(c.used(w.tenant, m) + w.gpu_milli <= q.guarantee(m) for m in model_names):
            return None
    lender_ok = _lender_check(c, w, mode, q, model_names)
    cands = _victim_candidates(c, w, mine, reclaim, model_names)
    fkey = c.fit_key(w)
    tenant_bound = reclaim or not c.cfg.priority_across_tenants
    vkey = (fkey, mode, w.tenant if tenant_bound else None, mine.value)
    if not cands or (fkey is not None and vkey in c.victim_fail):
        return None
    cands.sort(key=lambda cand: cand[0])
    need = w.request.shape.gpus * w.request.replicas
    if w.request.replicas == 1 and need:
        local = _node_local(c, need, cands, set(models), lender_ok)
        if local is None:
            if fkey is not None:
                c.victim_fail.add(vkey)
            return None
        cands = local
    placed = _victims_until_fit(c, w, cands, models, need, lender_ok)
    if placed is None:
        if fkey is not None:
            c.victim_fail.add(vkey)
        return None
    keep = _needed_victims(c, w, placed)
    for v in keep:
        for aid in v.alloc_ids:
            c.snap.release(aid)
    evict(c, keep, mode, w)
    return keep


def _lender_check(
    c: CycleState, w: Workload, mode: str, q: TenantQuota, model_names: set[str]
) -> _LenderCheck:
    """Whether a victim's tenant may lend for `w` under `mode`: `lender_ok(v, allocs, taken)`
    with `allocs` what evicting `v` frees on `w`'s models and `taken` what the victims
    chosen before it already took, per (tenant, model)."""
    hw = 1 - c.cfg.history_weight
    mine_after = share(c, w.tenant) + max(
        hw * w.gpu_milli / (c.s.capacity[m] * max(q.weight, 1e-9)) for m in model_names
    )
    shares: dict[str, float] = {}

    def lender_ok(v: Workload, allocs: list[tuple[str, int]], taken: dict) -> bool:
        if mode == "priority" and (v.tenant == w.tenant or c.cfg.priority_across_tenants):
            return True
        vq = c.s.quota(v.tenant)
        if mode == "reclaim":
            return any(
                c.used(v.tenant, m) - taken.get((v.tenant, m), 0) > vq.guarantee(m)
                for m, _ in allocs
            )
        if v.tenant not in shares:
            shares[v.tenant] = share(c, v.tenant)
        gone = sum(
            hw * (taken.get((v.tenant, m), 0) + milli) / (c.s.capacity[m] * max(vq.weight, 1e-9))
            for m, milli in allocs
        )
        return shares[v.tenant] - gone > mine_after

    return lender_ok


def _victim_candidates(
    c: CycleState, w: Workload, mine: PriorityClass, reclaim: bool, model_names: set[str]
) -> list[_Candidate]:
    """Running work `w` may evict, with its sort key and what it holds on `w`'s models."""
    cands: list[_Candidate] = []
    for v in c.running.values():
        if v.tenant == w.tenant and reclaim:
            continue
        if not evictable(c, v):
            continue
        pv = c.s.prio(v)
        if reclaim:
            if pv.value > mine.value:
                continue
        elif not (pv.value < mine.value or (pv.preemptible and not mine.preemptible)):
            continue

        allocs = [x for x in c.charge(v) if x[0] in model_names]
        if not allocs:
            continue
        assert v.started_at is not None
        # Least work lost first (none when it can checkpoint before it stops), then the
        # freshest checkpoint.
        lost = eviction_cost(c, v)
        cands.append(((pv.value, lost, v.lost_gpu_seconds(c.now), -v.started_at), v, allocs))
    return cands


def _victims_until_fit(
    c: CycleState,
    w: Workload,
    cands: list[_Candidate],
    models: list[int],
    need: int,
    lender_ok: _LenderCheck,
) -> list[Workload] | None:
    """Release candidates in order (within a checkpoint, rolled back) until `w` fits: the
    victims, or None when it never does."""
    mark = c.plan.checkpoint()
    chosen: list[Workload] = []
    placed = None
    over: dict[tuple[str, str], int] = {}
    for _, v, allocs in cands:
        if not lender_ok(v, allocs, over):
            continue
        for m, milli in allocs:
            over[(v.tenant, m)] = over.get((v.tenant, m), 0) + milli
        for aid in v.alloc_ids:
            c.snap.release(aid)
        chosen.append(v)
        if len(chosen) > c.cfg.max_victims:
            break
        if need and c.free_whole(models) < need:
            continue
        inner = c.plan.checkpoint()
        outcome = c.s.engine.place_one(w.request, c.plan)
        c.plan.rollback(inner)
        if outcome.placed:
            placed = chosen
            break
    c.plan.rollback(mark)
    return placed


def _needed_victims(c: CycleState, w: Workload, placed: list[Workload]) -> list[Workload]:
    """Drop victims that turn out not to be needed (the most expensive first)."""
    keep = list(placed)
    for v in sorted(placed, key=lambda x: -x.lost_gpu_seconds(c.now)):
        trial = [x for x in keep if x is not v]
        m2 = c.plan.checkpoint()
        for x in trial:
            for aid in x.alloc_ids:
                c.snap.release(aid)
        ok = c.s.engine.place_one(w.request, c.plan).placed
        c.plan.rollback(m2)
        if ok:
            keep = trial
    return keep


def eviction_cost(c: CycleState, v: Workload) -> float:
    """GPU-seconds lost if `v` is evicted now: none if it can checkpoint within its grace
    period, else its work since the last checkpoint."""
    if v.checkpoint_cost <= grace(c, v):
        return 0.0
    return v.lost_gpu_seconds(c.now)


def grace(c: CycleState, v: Workload) -> float:
    """How long victim `v` may run on: the grace period, extended up to `checkpoint_wait`
    when that lets it write its checkpoint."""
    cost = v.checkpoint_cost
    if cost <= c.cfg.grace_period or cost > c.cfg.checkpoint_wait:
        return c.cfg.grace_period
    return cost


def evict(c: CycleState, victims: list[Workload], reason: str, w: Workload) -> None:
    """Record the eviction of `victims` (whose allocations the caller has released) in
    favour of `w`: usage moves off their tenants and they stop after their grace period."""
    for v in victims:
        for m, milli in c.charge(v):
            c.add_usage(v.tenant, m, -milli)
        c.evicted.add(v.id)
        wait = grace(c, v)
        c.result.evictions.append(Eviction(v.id, reason, w.id, c.now + wait, eviction_cost(c, v)))
        del c.running[v.id]
    # Capacity grew: earlier failures no longer say anything.
    c.fail_cache.clear()
    c.fail_unheld.clear()
    c.victim_fail.clear()


def _node_local(c: CycleState, need: int, cands: list, models: set[int], lender_ok) -> list | None:
    """For a one-node shape: the node where the cheapest victims free `need` GPUs (lowest
    priority, then least lost work, then fewest victims); its victims, cheapest first."""
    snap = c.snap
    per_node: dict[int, list] = {}
    for cand in cands:
        for n in {snap.allocs[a].node for a in cand[1].alloc_ids}:
            per_node.setdefault(n, []).append(cand)
    best: tuple | None = None
    for n, lst in per_node.items():
        if int(snap.node_model[n]) not in models or not snap.node_open(n):
            continue
        free = len(snap.free_slots[n])
        take: list = []
        over: dict[tuple[str, str], int] = {}
        for cand in lst:
            if free >= need:
                break
            v, allocs = cand[1], cand[2]
            if not lender_ok(v, allocs, over):
                continue
            for m, milli in allocs:
                over[(v.tenant, m)] = over.get((v.tenant, m), 0) + milli
            free += sum(len(snap.allocs[a].slots) for a in v.alloc_ids if snap.allocs[a].node == n)
            take.append(cand)
        if free < need or not take:
            continue
        key = (
            max(t[0][0] for t in take),
            sum(t[0][1] for t in take),
            sum(t[0][2] for t in take),
            len(take),
            n,
        )
        if best is None or key < best[0]:
            best = (key, take)
    return None if best is None else best[1]


# --- the phases that evict -----------------------------------------------------------------------


def reclaim(c: CycleState) -> None:
    """Tenants within their guarantee take back capacity that others borrowed."""
    _take_back(c, "reclaim")


def fair_share(c: CycleState) -> None:
    """Tenants below their fair share take capacity from tenants above theirs (the donor
    stays above the taker after the move, so it cannot flip back)."""
    _take_back(c, "fair-share")


def _take_back(c: CycleState, mode: str) -> None:
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
    shares = {t: share(c, t) for t in per}
    order = sorted(
        heads,
        key=lambda w: (-c.s.prio(w).value, not w.expedited, shares[w.tenant], w.submitted_at, w.id),
    )
    for w in order:
        if w.id in c.done or tried.get(w.tenant, 0) >= c.cfg.reclaim_depth:
            continue
        if mode == "reclaim":
            q = c.s.quota(w.tenant)
            models = w.request.shape.models or c.snap.model_names
            if not any(c.used(w.tenant, m) + w.gpu_milli <= q.guarantee(m) for m in models):
                continue
        if over_limit(c, w):
            continue
        tried[w.tenant] = tried.get(w.tenant, 0) + 1
        placed = try_place(c, w)
        if placed is not None:
            admit(c, w, placed, mode)
            continue
        victims = victims_for(c, w, mode=mode)
        if victims is None:
            continue
        placed = try_place(c, w)
        if placed is not None:  # None only if the model it landed on is over its limit
            admit(c, w, placed, mode, tuple(v.id for v in victims))


def preempt(c: CycleState) -> None:
    """Blocked workloads evict strictly lower priorities, the least lost work first."""
    for w in list(c.blocked):
        if over_limit(c, w):
            continue
        victims = victims_for(c, w, mode="priority")
        if victims is None:
            continue
        placed = try_place(c, w)
        if placed is None:
            continue
        c.blocked.remove(w)
        c.result.blocked.pop(w.id, None)
        admit(c, w, placed, "preempt", tuple(v.id for v in victims))
