"""The defragment phase: multi-GPU work still waiting while the free GPUs lie scattered moves
small work (never of a higher priority) off the nodes closest to free, onto free GPUs
elsewhere."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from app.placement.isolation import Unit
from app.placement.model import Binding
from app.placement.queueing.admission import admit, over_limit, share, try_place
from app.placement.queueing.decisions import Workload
from app.placement.queueing.preemption import evict, evictable, eviction_cost
from app.placement.queueing.state import CycleState


def defragment(c: CycleState) -> None:
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
    waiting = _waiting(c)
    if not waiting:
        return
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
            key = (c.fit_key(w), c.s.prio(w).value, w.tenant)
            if key[0] is not None and key in failed:
                continue
            move = _make_room(c, w, owner)
            if move is None:
                failed.add(key)
                continue
            victims, placed, landed = move
            landing += landed
            for v in victims:
                for aid in v.alloc_ids:
                    owner.pop(aid, None)
            evict(c, victims, "defragment", w)
            admit(c, w, placed, "defragment", tuple(v.id for v in victims))
            moves += 1
    finally:
        for aid in landing:  # the moved work asks for GPUs again once it is queued
            snap.release(aid)


def _waiting(c: CycleState) -> list[Workload]:
    """The queue's multi-GPU whole-GPU work under its limits, in the order it is served."""
    waiting = [
        w
        for w in c.queue
        if w.id not in c.done
        and w.request.shape.unit is Unit.WHOLE
        and w.request.shape.gpus >= 2
        and not over_limit(c, w)
    ]
    waiting.sort(
        key=lambda w: (
            -c.s.prio(w).value,
            not w.expedited,
            share(c, w.tenant),
            w.submitted_at,
            w.id,
        )
    )
    return waiting


def _make_room(
    c: CycleState, w: Workload, owner: Mapping[int, Workload]
) -> tuple[list[Workload], tuple[Binding, ...], list[int]] | None:
    """Room for `w` by moving its victims: (victims, `w`'s bindings, their new allocs) or None."""
    snap = c.snap
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
        placed = try_place(c, w)  # gives its reservation up when placed
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
        if reservation is not None:  # any hold since the unhold was rolled back
            c.phantoms.pop(w.id, None)
            c.reserved[w.id] = reservation
            c.rehold(w.id)
        return None
    return victims, placed, landed


def _clear_nodes(
    c: CycleState, w: Workload, owner: Mapping[int, Workload]
) -> list[Workload] | None:
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


def _movable(c: CycleState, v: Workload, n: int, mine: int) -> bool:
    if v.id in c.evicted or not evictable(c, v) or c.s.prio(v).value > mine:
        return False
    if eviction_cost(c, v) > 0:  # its checkpoint outlasts the wait: a move would lose work
        return False
    r = v.request
    if r.replicas != 1 or r.shape.unit is not Unit.WHOLE:
        return False
    return all(c.snap.allocs[a].node == n for a in v.alloc_ids)
