"""An upper bound on the GPU allocation any placement policy can reach on an openb arrival
sequence under the published protocol: pods arrive one at a time, never move, and a pod that
fits somewhere is placed.

Why the protocol matters. With 130% of capacity offered, a scheduler free to choose which pods
to admit wastes nothing: the plain relaxation (pods assigned fractionally to classes of nodes)
fills the fleet, so it says nothing. What the best policies lose is capacity next to pods of more
than half a GPU ("big" pods: 550-810 milli on openb). No two share a GPU, and the rest of their
GPU (the hole, 190 milli next to an 810-milli pod) takes only pods no larger than the hole, which
are rare. A policy cannot refuse a big pod while any node could take it.

The witness is the most common big shape (milli, CPU, memory): 810 milli, 3.2 cores, 5.6 GiB on
the default list. Let t* be the arrival of the first witness pod that the policy drops:

- every witness pod before t* is placed;
- at t*, every node was closed to the witness: each of its GPUs had less than the witness's milli
  free (so none was whole), or its free CPU or memory was below the witness's. Pods never leave,
  so after t* a node closed by GPU takes no whole-GPU pod nor any pod of at least that milli, one
  closed by CPU no pod needing that much CPU, likewise memory;
- closing a node takes what was placed on it before t*: more than (1000 - milli) on every GPU, or
  more than (capacity - the witness's CPU) of CPU, or the same for memory.

One linear program per range of t*: every class of identical nodes is split fractionally into
the three ways of being closed, and the pods, grouped by shape and phase (before the range, inside
it, after it), are assigned fractionally to (class, way) pools within their GPU, CPU and memory
totals. A big pod takes its GPU whole; its hole is a capacity of its own that only pods no larger
than it may use. Pods inside the range (before its last witness pod) are neither forced nor
restricted and count toward closing. Packing within nodes is relaxed and every pod but the
forced ones may be dropped, so every real placement of the sequence is a feasible point of the
program for the range that holds its actual t* (or of the program where no witness is dropped):
the largest optimum bounds the allocation of any policy. Ranges are split while their program
promises more than the no-drop program; the bound is the largest value left, still valid if the
program budget runs out first.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from app.placement.snapshot import NodeSpec

BIG = 500  # fractional pods above this many milli never share a GPU with one another


@dataclass(frozen=True)
class Bound:
    pct: float  # upper bound on allocation, % of GPU capacity, at the end of the sequence
    offline_pct: float  # the same relaxation without the protocol's "a pod that fits is placed"
    first_drop_pct: float | None  # arrival % of the binding scenario's t* (None: no big drop)
    programs: int  # linear programs solved
    converged: bool  # False: the budget ran out; `pct` is still an upper bound, a looser one


@dataclass(frozen=True)
class _Cls:
    model: str
    gpus: int
    cpu: int
    mem: int
    count: int


def online_bound(
    nodes: list[NodeSpec], seq: list, *, first_ranges: int = 8, budget: int = 64
) -> Bound:
    """`seq`: the arrival sequence (openb `Pod`s) up to where the measured allocation ends."""
    counts: dict[tuple[str, int, int, int], int] = {}
    for node in nodes:
        key = (node.model, node.gpus, node.cpu_milli, node.mem_mib)
        counts[key] = counts.get(key, 0) + 1
    classes = [_Cls(*k, c) for k, c in counts.items()]
    capacity = sum(c.gpus * c.count for c in classes) * 1000
    shapes = [p.shape for p in seq]
    n = len(shapes)
    holes = sorted({s.milli for s in shapes if not s.gpus and s.milli > BIG})
    lp = _Program(classes, shapes, holes, capacity)
    offline = lp.solve(n, n, None, closed=False)
    keys = [_witness_key(s) for s in shapes]
    big = Counter(k for k in keys if k is not None)
    if not big:
        return Bound(_pct(offline, capacity), _pct(offline, capacity), None, 1, True)
    witness = big.most_common(1)[0][0]
    never = lp.solve(n, n, witness, closed=False)  # no witness pod is ever dropped
    cand = [i for i, k in enumerate(keys) if k == witness]

    def push(lo: int, hi: int) -> None:
        # The range's last witness pod is dropped at t* or arrives after it: it never counts
        # toward closing, so the "after" phase starts with it.
        value = lp.solve(cand[lo], cand[hi - 1], witness, closed=True)
        heapq.heappush(heap, (-value, lo, hi))

    heap: list[tuple[float, int, int]] = []  # ranges of candidate t* (indexes into cand)
    edges = np.linspace(0, len(cand), min(first_ranges, len(cand)) + 1).astype(int).tolist()
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        push(lo, hi)
    programs = 2 + len(heap)
    converged = True
    while -heap[0][0] > never and heap[0][2] - heap[0][1] > 1:
        if programs + 2 > budget:
            converged = False
            break
        _, lo, hi = heapq.heappop(heap)
        mid = (lo + hi) // 2
        push(lo, mid)
        push(mid, hi)
        programs += 2
    top, lo, _ = heap[0]
    if -top <= never:
        return Bound(_pct(never, capacity), _pct(offline, capacity), None, programs, converged)
    arrived = sum(s.gpu_milli for s in shapes[: cand[lo] + 1])
    return Bound(
        _pct(-top, capacity), _pct(offline, capacity), arrived * 100 / capacity, programs, converged
    )


def _witness_key(s) -> tuple[int, int, int] | None:
    """(milli, CPU, memory) of a big share any GPU model may take; None for other pods."""
    if s.gpus or s.milli <= BIG or s.models is not None:
        return None
    return (s.milli, s.cpu_milli, s.mem_mib)


def _pct(value: float, capacity: int) -> float:
    return value * 100 / capacity if value > float("-inf") else float("nan")


class _Program:
    """The linear program for one range of t*, built from shape groups per phase."""

    def __init__(self, classes: list[_Cls], shapes: list, holes: list[int], capacity: int):
        self.classes = classes
        self.shapes = shapes
        self.holes = holes
        self.capacity = capacity

    def solve(self, a: int, b: int, witness: tuple[int, int, int] | None, *, closed: bool) -> float:
        """The most GPU milli placed when t* lies in [a, b): witness pods (milli, CPU, memory)
        before it are placed and, if `closed`, every node is closed to the witness at t*.
        No witness (and a = b = len): the offline relaxation."""
        closing = witness if closed else None
        pools = ("gpu", "cpu", "mem") if closing else ("all",)
        groups: dict[tuple, int] = {}
        for i, s in enumerate(self.shapes):
            phase = 0 if i < a else (1 if i < b else 2)
            key = (phase, s.gpus, s.milli, s.cpu_milli, s.mem_mib, s.models)
            groups[key] = groups.get(key, 0) + 1
        # Rows of A_ub x <= b_ub are numbered 0, 1, ...; rows of A_eq x = b_eq -1, -2, ...
        entries: dict[bool, tuple[list[int], list[int], list[float]]] = {
            False: ([], [], []),
            True: ([], [], []),
        }
        rhs: dict[bool, list[float]] = {False: [], True: []}
        obj: list[float] = []
        bounds: list[tuple[float, float | None]] = []

        def new_row(value: float, eq: bool = False) -> int:
            rhs[eq].append(value)
            return -len(rhs[eq]) if eq else len(rhs[eq]) - 1

        def new_col(value: float, lo: float = 0.0, hi: float | None = None) -> int:
            obj.append(-value)
            bounds.append((lo, hi))
            return len(obj) - 1

        def put(row: int, col: int, v: float) -> None:
            rows, cols, vals = entries[row < 0]
            rows.append(-1 - row if row < 0 else row)
            cols.append(col)
            vals.append(v)

        # Pools: node counts and their capacity rows.
        cap_rows: dict[tuple[int, str], tuple[int, int, int]] = {}
        close_rows: dict[tuple[int, str], int] = {}
        for k, c in enumerate(self.classes):
            share = new_row(c.count, eq=True) if closing else None
            for p in pools:
                col = new_col(0.0, 0.0, None) if closing else new_col(0.0, c.count, c.count)
                if share is not None:
                    put(share, col, 1.0)
                g, cpu, mem = new_row(0.0), new_row(0.0), new_row(0.0)
                put(g, col, -1000.0 * c.gpus)
                put(cpu, col, -float(c.cpu))
                put(mem, col, -float(c.mem))
                cap_rows[k, p] = (g, cpu, mem)
                if closing:
                    m, ccpu, cmem = closing
                    # Closing a node costs more than this much of the resource placed before t*.
                    need = {
                        "gpu": c.gpus * (1000 - m + 1),
                        "cpu": c.cpu - ccpu + 1,
                        "mem": c.mem - cmem + 1,
                    }[p]
                    close_rows[k, p] = new_row(0.0)
                    put(close_rows[k, p], col, float(need))
        hole_rows = {
            (k, p, h): new_row(0.0)
            for k in range(len(self.classes))
            for p in pools
            for h in self.holes
        }
        for (phase, gpus, milli, cpu, mem, models), count in groups.items():
            big = not gpus and milli > BIG
            must = phase == 0 and models is None and not gpus and (milli, cpu, mem) == witness
            cnt = new_row(float(count), eq=must)
            charge = 1000 * gpus if gpus else (1000 if big else milli)
            value = 1000 * gpus if gpus else milli
            for k, c in enumerate(self.classes):
                if models is not None and c.model not in models:
                    continue
                if gpus > c.gpus or cpu > c.cpu or mem > c.mem:
                    continue
                for p in pools:
                    if (
                        phase == 2
                        and closing
                        and not self._open_after(p, gpus, milli, cpu, mem, closing)
                    ):
                        continue
                    g_row, c_row, m_row = cap_rows[k, p]
                    x = new_col(float(value))
                    put(cnt, x, 1.0)
                    put(g_row, x, float(charge))
                    put(c_row, x, float(cpu))
                    put(m_row, x, float(mem))
                    if big:
                        put(hole_rows[k, p, milli], x, -float(1000 - milli))
                    if closing and phase < 2:
                        used = {"gpu": charge, "cpu": cpu, "mem": mem}[p]
                        put(close_rows[k, p], x, -float(used))
                    if gpus or big or not milli:
                        continue
                    for h in self.holes:  # a small share in the hole next to a big pod
                        if milli > 1000 - h:
                            continue
                        y = new_col(float(milli))
                        put(cnt, y, 1.0)
                        put(hole_rows[k, p, h], y, float(milli))
                        put(c_row, y, float(cpu))
                        put(m_row, y, float(mem))
                        if closing and phase < 2 and p != "gpu":
                            put(close_rows[k, p], y, -float(cpu if p == "cpu" else mem))
        ncol = len(obj)
        a_ub, a_eq = (
            coo_matrix((entries[eq][2], entries[eq][:2]), shape=(len(rhs[eq]), ncol)).tocsr()
            for eq in (False, True)
        )
        res = linprog(
            np.asarray(obj),
            A_ub=a_ub,
            b_ub=np.asarray(rhs[False]),
            A_eq=a_eq if rhs[True] else None,
            b_eq=np.asarray(rhs[True]) if rhs[True] else None,
            bounds=bounds,
            method="highs",
        )
        if res.status == 2:  # infeasible: t* cannot lie in this range
            return float("-inf")
        if res.status != 0:  # not solved: fall back to the trivial bound, the whole fleet
            return float(self.capacity)
        return float(-res.fun)

    @staticmethod
    def _open_after(
        pool: str, gpus: int, milli: int, cpu: int, mem: int, closing: tuple[int, int, int]
    ) -> bool:
        """May a pod arriving after t* still land on a node closed this way at t*?"""
        m, ccpu, cmem = closing
        if pool == "gpu":
            return not gpus and milli < m
        if pool == "cpu":
            return cpu < ccpu
        return mem < cmem
