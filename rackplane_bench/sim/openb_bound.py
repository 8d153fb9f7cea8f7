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
from dataclasses import dataclass, field

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


class _Lp:
    """A sparse linear program, maximised, built a row and a column at a time. Rows of
    A_ub x <= b_ub are numbered 0, 1, ...; rows of A_eq x = b_eq -1, -2, ..."""

    def __init__(self) -> None:
        self.entries: dict[bool, tuple[list[int], list[int], list[float]]] = {
            False: ([], [], []),
            True: ([], [], []),
        }
        self.rhs: dict[bool, list[float]] = {False: [], True: []}
        self.obj: list[float] = []
        self.bounds: list[tuple[float, float | None]] = []

    def row(self, value: float, eq: bool = False) -> int:
        """A new row (`<= value`, or `= value`); its number."""
        self.rhs[eq].append(value)
        return -len(self.rhs[eq]) if eq else len(self.rhs[eq]) - 1

    def col(self, value: float, lo: float = 0.0, hi: float | None = None) -> int:
        """A new variable worth `value` in the objective, within [lo, hi]; its number."""
        self.obj.append(-value)
        self.bounds.append((lo, hi))
        return len(self.obj) - 1

    def put(self, row: int, col: int, v: float) -> None:
        """The coefficient of variable `col` in `row`."""
        rows, cols, vals = self.entries[row < 0]
        rows.append(-1 - row if row < 0 else row)
        cols.append(col)
        vals.append(v)

    def solve(self, capacity: int) -> float:
        """The optimum; -inf when infeasible, `capacity` (the trivial bound) when unsolved."""
        rhs, ncol = self.rhs, len(self.obj)
        a_ub, a_eq = (
            coo_matrix(
                (self.entries[eq][2], self.entries[eq][:2]), shape=(len(rhs[eq]), ncol)
            ).tocsr()
            for eq in (False, True)
        )
        res = linprog(
            np.asarray(self.obj),
            A_ub=a_ub,
            b_ub=np.asarray(rhs[False]),
            A_eq=a_eq if rhs[True] else None,
            b_eq=np.asarray(rhs[True]) if rhs[True] else None,
            bounds=self.bounds,
            method="highs",
        )
        if res.status == 2:  # infeasible: t* cannot lie in this range
            return float("-inf")
        if res.status != 0:  # not solved: fall back to the trivial bound, the whole fleet
            return float(capacity)
        return float(-res.fun)


@dataclass
class _Pools:
    """One program's pools, a (class, way of being closed) each: their capacity rows (GPU
    milli, CPU, memory), their closing rows, and the rows of the holes next to big pods."""

    names: tuple[str, ...]
    closing: tuple[int, int, int] | None  # the witness the nodes are closed to at t*, if any
    cap: dict[tuple[int, str], tuple[int, int, int]] = field(default_factory=dict)
    close: dict[tuple[int, str], int] = field(default_factory=dict)
    hole: dict[tuple[int, str, int], int] = field(default_factory=dict)


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
        lp = _Lp()
        pools = self._pools(lp, witness if closed else None)
        for key, count in self._groups(a, b).items():
            self._group(lp, pools, key, count, witness)
        return lp.solve(self.capacity)

    def _groups(self, a: int, b: int) -> dict[tuple, int]:
        """Pods counted by (phase, GPUs, milli, CPU, memory, models); phase 0 before a, 1 in
        [a, b), 2 after."""
        groups: dict[tuple, int] = {}
        for i, s in enumerate(self.shapes):
            phase = 0 if i < a else (1 if i < b else 2)
            key = (phase, s.gpus, s.milli, s.cpu_milli, s.mem_mib, s.models)
            groups[key] = groups.get(key, 0) + 1
        return groups

    def _pools(self, lp: _Lp, closing: tuple[int, int, int] | None) -> _Pools:
        """Pools: node counts and their capacity rows, closing rows, and hole rows."""
        pools = _Pools(("gpu", "cpu", "mem") if closing else ("all",), closing)
        for k, c in enumerate(self.classes):
            share = lp.row(c.count, eq=True) if closing else None
            for p in pools.names:
                col = lp.col(0.0, 0.0, None) if closing else lp.col(0.0, c.count, c.count)
                if share is not None:
                    lp.put(share, col, 1.0)
                g, cpu, mem = lp.row(0.0), lp.row(0.0), lp.row(0.0)
                lp.put(g, col, -1000.0 * c.gpus)
                lp.put(cpu, col, -float(c.cpu))
                lp.put(mem, col, -float(c.mem))
                pools.cap[k, p] = (g, cpu, mem)
                if closing:
                    m, ccpu, cmem = closing
                    # Closing a node costs more than this much of the resource placed before t*.
                    need = {
                        "gpu": c.gpus * (1000 - m + 1),
                        "cpu": c.cpu - ccpu + 1,
                        "mem": c.mem - cmem + 1,
                    }[p]
                    pools.close[k, p] = lp.row(0.0)
                    lp.put(pools.close[k, p], col, float(need))
        pools.hole = {
            (k, p, h): lp.row(0.0)
            for k in range(len(self.classes))
            for p in pools.names
            for h in self.holes
        }
        return pools

    def _group(
        self,
        lp: _Lp,
        pools: _Pools,
        key: tuple,
        count: int,
        witness: tuple[int, int, int] | None,
    ) -> None:
        """A group's count row and its variables: its pods in each pool that may take them."""
        phase, gpus, milli, cpu, mem, models = key
        closing = pools.closing
        big = not gpus and milli > BIG
        must = phase == 0 and models is None and not gpus and (milli, cpu, mem) == witness
        cnt = lp.row(float(count), eq=must)
        charge = 1000 * gpus if gpus else (1000 if big else milli)
        value = 1000 * gpus if gpus else milli
        for k, c in enumerate(self.classes):
            if models is not None and c.model not in models:
                continue
            if gpus > c.gpus or cpu > c.cpu or mem > c.mem:
                continue
            for p in pools.names:
                if (
                    phase == 2
                    and closing
                    and not self._open_after(p, gpus, milli, cpu, mem, closing)
                ):
                    continue
                g_row, c_row, m_row = pools.cap[k, p]
                x = lp.col(float(value))
                lp.put(cnt, x, 1.0)
                lp.put(g_row, x, float(charge))
                lp.put(c_row, x, float(cpu))
                lp.put(m_row, x, float(mem))
                if big:
                    lp.put(pools.hole[k, p, milli], x, -float(1000 - milli))
                if closing and phase < 2:
                    used = {"gpu": charge, "cpu": cpu, "mem": mem}[p]
                    lp.put(pools.close[k, p], x, -float(used))
                if gpus or big or not milli:
                    continue
                self._in_holes(lp, pools, k, p, cnt, key)

    def _in_holes(self, lp: _Lp, pools: _Pools, k: int, p: str, cnt: int, key: tuple) -> None:
        """A small share's variables in each hole next to a big pod that it fits."""
        phase, _gpus, milli, cpu, mem, _models = key
        _g_row, c_row, m_row = pools.cap[k, p]
        for h in self.holes:
            if milli > 1000 - h:
                continue
            y = lp.col(float(milli))
            lp.put(cnt, y, 1.0)
            lp.put(pools.hole[k, p, h], y, float(milli))
            lp.put(c_row, y, float(cpu))
            lp.put(m_row, y, float(mem))
            if pools.closing and phase < 2 and p != "gpu":
                lp.put(pools.close[k, p], y, -float(cpu if p == "cpu" else mem))

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
