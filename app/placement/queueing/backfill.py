"""Backfill and reservations, as functions of the cycle's state: the earliest start of a
blocked workload from the declared maximum runtimes of what runs (and the GPUs it would take
then), reservations carried over from the last cycle, and the backfill phase, which reserves
for the blocked head and admits only what cannot delay it."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

import numpy as np

from app.placement.queueing.admission import admit, over_limit, try_place
from app.placement.queueing.decisions import Reservation, Workload
from app.placement.queueing.state import CycleState

# --- reservations --------------------------------------------------------------------------------


def reservation_for(c: CycleState, w: Workload) -> Reservation | None:
    """The earliest start of `w` from the declared maximum runtimes of what runs, and the
    GPUs it would take then. Running work holding GPUs of an earlier reservation is never
    counted as ending (those GPUs are promised)."""
    promised = {g for _, gpus in c.reserved.values() for g in gpus}
    snap = c.snap
    ends: list[tuple[float, list[int]]] = []
    for v in c.running.values():
        if v.started_at is None:
            continue
        aids = list(v.alloc_ids)
        if promised and any(
            (snap.allocs[a].node, s) in promised for a in aids for s in snap.allocs[a].slots
        ):
            continue
        ends.append((max(c.now, v.started_at + v.max_runtime), aids))
    for adm in c.result.admissions:
        ends.append(
            (adm.start_at + _max_runtime(c, adm.workload), [b.alloc_id for b in adm.bindings])
        )
    ends.sort(key=lambda e: e[0])
    models = c.s.engine.allowed_models(w.request.shape, w.request.tier)
    need = w.request.shape.gpus * w.request.replicas
    bound = _earliest_bound(c, w, ends, models)
    if bound == math.inf:
        return None
    mark = c.plan.checkpoint()
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
            if need and c.free_whole(models) < need:
                continue
            outcome = c.s.engine.place_one(w.request, c.plan)
            if outcome.placed:
                gpus = tuple((b.node, g) for b in outcome.bindings for g in b.gpu_indices)
                found = Reservation(w.id, t, gpus)
                break
    finally:
        c.plan.rollback(mark)
    return found


def _earliest_bound(
    c: CycleState, w: Workload, ends: list[tuple[float, list[int]]], models
) -> float:
    """A lower bound on when a whole-GPU `w` could start (`now` for other shapes), from when
    each GPU comes free: a GPU is free once every allocation on it has ended (never, for
    GPUs held beyond the declared ends), and a node hosts a replica per `gpus` free GPUs.
    Optimistic (ignores host resources, topology and MIG re-layout), so the exact search
    may start there; `inf` when not even that is ever enough."""
    per, reps = w.request.shape.gpus, w.request.replicas
    if not per:
        return c.now
    snap = c.snap
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
        return c.now
    steps: list[float] = []
    for n, slots in gpu_end.items():
        if not open_idle[n]:
            continue
        times = sorted(slots.values())
        times = [c.now] * (int(ngpu[n]) - len(times)) + times
        steps.extend(times[k * per - 1] for k in range(1, int(ngpu[n]) // per + 1))
    need = reps - now_count
    if len(steps) < need:
        return math.inf
    return max(c.now, heapq.nsmallest(need, steps)[-1])


def _max_runtime(c: CycleState, wid: str) -> float:
    return c.by_id[wid].max_runtime


def carry(c: CycleState, previous: Mapping[str, Reservation]) -> None:
    """Hold again, on the same GPUs, the reservations of workloads still waiting (a
    reservation recomputed every cycle drifts later as other work fills its GPUs). One
    whose GPUs are no longer reachable is dropped; its workload gets a new one."""
    snap = c.snap
    end: dict[int, float] = {}
    for v in c.running.values():
        if v.started_at is not None:
            for aid in v.alloc_ids:
                end[aid] = max(c.now, v.started_at + v.max_runtime)
    for wid, res in previous.items():
        w = c.by_id.get(wid)
        if w is None or len(c.reserved) >= c.cfg.max_reservations:
            continue
        start = c.now
        for node, g in res.gpus:
            n = snap.node_index.get(node)
            if n is None or not snap.node_sched[n]:
                start = math.inf
                break
            for aid in snap.holders.get(n * snap.max_gpus + g, ()):
                start = max(start, end.get(aid, math.inf))
        if start < math.inf:
            c.hold(Reservation(wid, start, res.gpus))


# --- the backfill phase --------------------------------------------------------------------------


def backfill(c: CycleState) -> None:
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
        res = reservation_for(c, w)
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
        if over := over_limit(c, w):
            c.result.blocked[w.id] = over
            continue
        placed = try_place(c, w)
        if placed is None and short:
            # Ends before any reservation starts: it may use reserved GPUs.
            saved, c.fail_cache = c.fail_cache, c.fail_unheld
            if not c.known_to_fail(w):
                c.unhold()
                placed = try_place(c, w)
                c.rehold()
            c.fail_cache = saved
        if placed is not None:
            admit(c, w, placed, "backfill")
            continue
        c.result.blocked[w.id] = "no capacity"
        reserve(w)
    c.walk = None
