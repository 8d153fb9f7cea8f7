"""Fragmentation Gradient Descent (Weng et al., USENIX ATC'23) and Rackplane's default.

A node's fragmentation, measured against the typical task shapes m (frequencies p_m), is the
idle GPU milli that m cannot use there: all of it if m cannot fit on the node at all,
otherwise the idle milli on GPUs with less free than m needs per GPU. A candidate's score is
how much it changes its node's fragmentation.

Per-node terms are cached (invalidated by the snapshot's node versions) and a candidate's
"after" terms are derived incrementally from them, so scoring every feasible GPU of a
1,000-node fleet costs a few vector operations over (candidates x typical shapes).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from app.placement.engine import Candidates
from app.placement.model import Request, Shape
from app.placement.policies.base import Policy
from app.placement.snapshot import Snapshot


@dataclass(frozen=True)
class TypicalShape:
    cpu_milli: int
    milli: int  # per GPU: 1000 for whole GPUs, the share for fractional, 0 for CPU-only
    gpus: int
    models: frozenset[str] | None
    freq: float


def shape_key(shape: Shape) -> tuple[int, int, int, frozenset[str] | None]:
    cpu = shape.cpu_milli or 100  # as the published simulator: a zero request counts as 100m
    if shape.gpus:
        return cpu, 1000, shape.gpus, shape.models
    if shape.cpu_only:
        return cpu, 0, 0, shape.models
    return cpu, shape.gpu_milli, 1, shape.models


def typical_shapes(shapes: Iterable[Shape], coverage: float = 0.95) -> list[TypicalShape]:
    """The most frequent shapes covering `coverage` of all tasks (the one that crosses the line
    included), with frequencies renormalised to sum to 1."""
    counts = Counter(shape_key(s) for s in shapes)
    total = sum(counts.values())
    picked, cum = [], 0
    for key, c in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        if cum >= coverage * total:
            break
        picked.append((key, c))
        cum += c
    return [TypicalShape(k[0], k[1], k[2], k[3], c / cum) for k, c in picked]


DEFAULT_TYPICAL = typical_shapes(
    [Shape(gpus=1, cpu_milli=8000)] * 4
    + [Shape(gpus=8, cpu_milli=64000)] * 2
    + [Shape(gpus=2, cpu_milli=16000), Shape(gpus=4, cpu_milli=32000)]
    + [Shape(milli=500, cpu_milli=4000), Shape(milli=250, cpu_milli=2000)],
    coverage=1.0,
)


class FragModel:
    """Fragmentation of every node against a set of typical shapes, cached per node."""

    def __init__(self, typical: list[TypicalShape]):
        self.typical = typical
        self.cpu = np.array([t.cpu_milli for t in typical], np.int64)
        self.mu = np.array([t.milli for t in typical], np.int64)
        self.num = np.array([t.gpus for t in typical], np.int64)
        self.p = np.array([t.freq for t in typical], np.float64)
        self.cpu_only = self.mu == 0
        self._t = range(len(typical))
        self._cpu_l, self._mu_l = self.cpu.tolist(), self.mu.tolist()
        self._num_l, self._p_l = self.num.tolist(), self.p.tolist()
        self._cpu_only_l = self.cpu_only.tolist()
        self._snap_id: int | None = None
        self._version: np.ndarray = np.empty(0, np.int64)

    def _bind(self, snap: Snapshot) -> None:
        if self._snap_id == snap.token:
            return
        self._snap_id = snap.token
        self.model_ok = _model_ok(self.typical, snap)
        n, t = len(snap.node_names), len(self.typical)
        self.sum = np.zeros((n, t), np.float64)
        self.cnt = np.zeros((n, t), np.int64)
        self.idle = np.zeros(n, np.float64)
        self.node_frag = np.zeros(n, np.float64)
        self._version = np.full(n, -1, np.int64)
        self._epoch = -1
        self._ok_l = self.model_ok.tolist()

    def refresh(self, snap: Snapshot) -> None:
        self._bind(snap)
        stale = _stale_nodes(self, snap)
        if stale is None:
            return
        if len(stale) <= 8:  # plain Python beats numpy's per-call cost for a few nodes
            for n in stale.tolist():
                free = sorted(f for f in snap.gpu_free[n].tolist() if f >= 0)
                prefix = list(itertools.accumulate(free, initial=0))
                cuts = [bisect.bisect_left(free, mu) for mu in self._mu_l]
                sums = [float(prefix[k]) for k in cuts]  # free milli on GPUs below mu
                cnts = [len(free) - k for k in cuts]  # GPUs with at least mu free
                idle = float(prefix[-1])
                self.sum[n], self.cnt[n], self.idle[n] = sums, cnts, idle
                self.node_frag[n] = self._frag_one(
                    int(snap.node_model[n]), int(snap.node_cpu_free[n]), sums, cnts, idle
                )
                self._version[n] = snap.node_version[n]
            return
        free = snap.gpu_free[stale].astype(np.int64)  # [k, G], -1 for absent GPUs
        present = free >= 0
        f = free[:, :, None]
        mu = self.mu[None, None, :]
        self.sum[stale] = np.where(present[:, :, None] & (f < mu), f, 0).sum(axis=1)
        self.cnt[stale] = (present[:, :, None] & (f >= mu)).sum(axis=1)
        self.idle[stale] = np.where(present, free, 0).sum(axis=1)
        self.node_frag[stale] = self.frag(
            snap.node_model[stale],
            snap.node_cpu_free[stale],
            self.sum[stale],
            self.cnt[stale],
            self.idle[stale],
        )
        self._version[stale] = snap.node_version[stale]

    def frag(
        self,
        models: np.ndarray,
        cpu: np.ndarray,
        sums: np.ndarray,
        cnts: np.ndarray,
        idle: np.ndarray,
    ) -> np.ndarray:
        fits = (
            self.model_ok[models]
            & (cpu[:, None] >= self.cpu[None, :])
            & (cnts >= self.num[None, :])
            & ~self.cpu_only[None, :]
        )
        return (np.where(fits, sums, idle[:, None]) * self.p[None, :]).sum(axis=1)

    def _frag_one(self, model: int, cpu: int, sums, cnts, idle: float) -> float:
        ok, cpu_t, num, p = self._ok_l[model], self._cpu_l, self._num_l, self._p_l
        out = 0.0
        for t in self._t:
            fits = ok[t] and not self._cpu_only_l[t] and cpu >= cpu_t[t] and cnts[t] >= num[t]
            out += p[t] * (sums[t] if fits else idle)
        return out

    def _delta_small(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        shape = req.shape
        rows = cands.node
        sums_l, cnts_l = self.sum[rows].tolist(), self.cnt[rows].tolist()
        idles, frag0 = self.idle[rows].tolist(), self.node_frag[rows].tolist()
        cpus, models = snap.node_cpu_free[rows].tolist(), snap.node_model[rows].tolist()
        frac = not (shape.gpus or shape.cpu_only)
        if frac:
            frees = snap.gpu_free[rows, np.maximum(cands.slot, 0)].tolist()
        g, m, c, mus = shape.gpus, shape.gpu_milli, shape.cpu_milli, self._mu_l
        out = []
        for i in range(len(rows)):
            s0, c0 = sums_l[i], cnts_l[i]
            if g:
                s1, c1, i1 = s0, [x - g for x in c0], idles[i] - 1000 * g
            elif shape.cpu_only:
                s1, c1, i1 = s0, c0, idles[i]
            else:
                a = frees[i]
                a1 = a - m
                s1 = [
                    s0[t] - (a if a < mus[t] else 0) + (a1 if a1 < mus[t] else 0) for t in self._t
                ]
                c1 = [c0[t] - (a >= mus[t]) + (a1 >= mus[t]) for t in self._t]
                i1 = idles[i] - m
            out.append(self._frag_one(models[i], cpus[i] - c, s1, c1, i1) - frag0[i])
        return np.asarray(out, np.float64)

    def delta(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        """Fragmentation after minus before, per candidate (in GPU milli).

        Candidates that leave their node in the same state (same node, same free milli on the
        chosen GPU) share one evaluation."""
        self.refresh(snap)
        if len(cands) <= 64:
            return self._delta_small(snap, req, cands)
        shape = req.shape
        a_all, first, back = _same_outcome(snap, req, cands)
        nodes = cands.node[first]
        models = snap.node_model[nodes]
        cpu1 = snap.node_cpu_free[nodes] - shape.cpu_milli
        s0, c0, i0 = self.sum[nodes], self.cnt[nodes], self.idle[nodes]
        if shape.gpus:
            s1, c1, i1 = s0, c0 - shape.gpus, i0 - 1000 * shape.gpus
        elif shape.cpu_only:
            s1, c1, i1 = s0, c0, i0
        else:
            a = a_all[first][:, None]
            a1 = a - shape.gpu_milli
            mu = self.mu[None, :]
            s1 = s0 - np.where(a < mu, a, 0) + np.where(a1 < mu, a1, 0)
            c1 = c0 - (a >= mu) + (a1 >= mu)
            i1 = i0 - shape.gpu_milli
        after = self.frag(models, cpu1, s1, c1, i1)
        return (after - self.node_frag[nodes])[back]


def _model_ok(typical: list[TypicalShape], snap: Snapshot) -> np.ndarray:
    """[model, shape]: whether each typical shape may run on each of the fleet's GPU models."""
    return np.array(
        [[t.models is None or m in t.models for m in snap.model_names] for t in typical], np.bool_
    ).T


def _same_outcome(snap: Snapshot, req: Request, cands: Candidates):
    """Group candidates that leave their node in the same state (same node and, for shares,
    same free milli on the chosen GPU). Returns (free milli at each candidate's GPU or None,
    index of each group's first candidate, group of every candidate)."""
    shape = req.shape
    a_all = None
    if shape.gpus or shape.cpu_only:
        key = cands.node
    else:
        a_all = snap.gpu_free[cands.node, np.maximum(cands.slot, 0)].astype(np.int64)
        key = cands.node * 1024 + a_all
    if len(key) > 256:
        _u, first, back = np.unique(key, return_index=True, return_inverse=True)
    else:  # small sets: evaluating duplicates is cheaper than finding them
        first = back = np.arange(len(key))
    return a_all, first, back


def _stale_nodes(model, snap: Snapshot) -> np.ndarray | None:
    """Nodes whose cached terms are out of date (None if none), from the snapshot's change log
    when possible, else by comparing node versions."""
    changed, epoch, pos = snap.changes_since(
        getattr(model, "_epoch", -1), getattr(model, "_pos", 0)
    )
    model._epoch, model._pos = epoch, pos
    if changed is None or len(changed) > 64:
        stale = np.flatnonzero(model._version != snap.node_version)
    else:
        stale = np.fromiter(set(changed), np.int64)
        stale = stale[model._version[stale] != snap.node_version[stale]]
    return stale if len(stale) else None


class FGD(Policy):
    """FGD as published: score = int(100 * sigmoid(-delta / 1000)), random among tied nodes,
    the lowest GPU index among tied GPUs of the chosen node."""

    name = "fgd"
    random_ties = True

    def __init__(self, seed: int | None = None, typical: list[TypicalShape] | None = None):
        super().__init__(seed)
        self.model = FragModel(typical or DEFAULT_TYPICAL)

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        d = self.model.delta(snap, req, cands)
        return -np.floor(100.0 / (1.0 + np.exp(d / 1000.0)))


class RackplanePolicy(Policy):
    """Rackplane's default: FGD's score over fragmentation *plus* the GPU capacity the node's
    host CPU could no longer feed (`HostModel`), both in GPU milli, through FGD's integer
    sigmoid; then the expected stranded capacity of FillModel to choose among the ties; then a
    fixed random fleet order (which packs). Topology and health scorers add to it in the engine.

    On openb this beats FGD on every list tried (see BENCHMARKS.md). FGD only sees CPU when it
    stops a typical shape from fitting at all, so it fills CPU-poor nodes with CPU-hungry work
    and strands their GPUs; the host term keeps each node's CPU in step with its free GPUs.
    """

    name = "rackplane"
    random_ties = True
    fill_quantum = 1000.0  # milli-GPU

    def __init__(
        self,
        seed: int | None = None,
        typical: list[TypicalShape] | None = None,
        candidate_limit: int | None = None,
    ):
        super().__init__(seed)
        typ = typical or DEFAULT_TYPICAL
        self.frag = FragModel(typ)
        self.host = HostModel(typ)
        self.fill = FillModel(typ)
        self.candidate_limit = candidate_limit

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        if len(cands) <= 64:
            # Index-sized candidate sets repeat node states (identical empty nodes, say):
            # score each distinct state once.
            uniq, back = _distinct_states(snap, cands)
            if len(uniq) < len(cands):
                return self._score(snap, req, uniq)[back]
        return self._score(snap, req, cands)

    def _score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        delta = self.frag.delta(snap, req, cands) + self.host.delta(snap, req, cands)
        points = np.floor(100.0 / (1.0 + np.exp(delta / 1000.0)))
        score = -points
        best = np.flatnonzero(score == score.min())
        if len(best) > 1:
            # Fill deltas are GPU milli (|d| < 1e5): scaled below one FGD point, they only order
            # FGD's ties, so only the tied candidates need them.
            tied = Candidates(cands.node[best], cands.slot[best], cands.kind[best])
            # Only a difference of a whole GPU of stranded capacity overrides the fixed order:
            # finer differences are noise next to the packing that the order gives.
            fill = np.floor(self.fill.delta(snap, req, tied) / self.fill_quantum)
            score[best] += fill * 1e-6
        return score


class HostModel:
    """GPU capacity a node's host CPU can no longer feed: the idle GPU milli beyond what its
    free CPU supports at the typical work's ratio of GPU to CPU (frequency-weighted over the
    typical GPU shapes). Zero while CPU keeps up with the idle GPUs.

    FGD counts CPU only where it stops a typical shape from fitting at all; by then the GPUs of
    a CPU-poor node are lost. On openb, a fleet of 12-core-per-GPU nodes next to 52-core ones,
    that loss was 0.7% of all GPU capacity at the end of a run (seed 42, default list).
    """

    def __init__(self, typical: list[TypicalShape]):
        gpu_shapes = [t for t in typical if t.milli > 0]
        gpu = sum(t.freq * t.milli * t.gpus for t in gpu_shapes)
        cpu = sum(t.freq * t.cpu_milli for t in gpu_shapes)  # shape_key counts 0 CPU as 100
        self.milli_per_cpu = gpu / cpu if cpu else 0.0  # GPU milli per CPU milli-core

    def delta(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        nodes = cands.node
        k = self.milli_per_cpu
        if not k:  # no typical GPU work: nothing to feed
            return np.zeros(len(nodes))
        shape = req.shape
        idle = snap.gpu_free[nodes].clip(0).sum(axis=1)  # absent GPUs hold -1
        short = idle - k * snap.node_cpu_free[nodes]  # stranded where positive
        after = short + (k * shape.cpu_milli - shape.gpu_milli)
        return np.maximum(after, 0.0) - np.maximum(short, 0.0)


def _distinct_states(snap: Snapshot, cands: Candidates) -> tuple[Candidates, np.ndarray]:
    """Candidates with distinct (model, GPU row, chosen slot, CPU) states, and the index
    mapping every candidate to its representative."""
    raw = snap.gpu_free[cands.node].tobytes()
    width = len(raw) // max(len(cands), 1)
    cpus = snap.node_cpu_free[cands.node].tolist()
    models = snap.node_model[cands.node].tolist()
    slots = cands.slot.tolist()
    seen: dict[tuple, int] = {}
    first: list[int] = []
    back = np.empty(len(cpus), np.int64)
    for i in range(len(cpus)):
        key = (models[i], raw[i * width : (i + 1) * width], cpus[i], slots[i])
        j = seen.get(key)
        if j is None:
            j = seen[key] = len(first)
            first.append(i)
        back[i] = j
    idx = np.asarray(first, np.int64)
    return Candidates(cands.node[idx], cands.slot[idx], cands.kind[idx]), back


class FillModel:
    """Expected stranded GPU capacity: for each typical shape t, the idle GPU milli on a node
    that copies of t could NOT use if the node were filled with them, counting GPU *and* CPU
    (and model) limits; weighted by the shapes' frequencies.

    FGD asks whether one copy of t still fits; this asks how much capacity copies of t could
    still use, so it sees that 20 free cores next to 4 free GPUs will strand 3 of them.
    """

    def __init__(self, typical: list[TypicalShape]):
        gpu_shapes = [t for t in typical if t.milli > 0]
        self.typical = gpu_shapes
        self.cpu = np.array([max(t.cpu_milli, 1) for t in gpu_shapes], np.int64)
        self.mu = np.array([t.milli for t in gpu_shapes], np.int64)
        self.num = np.array([t.gpus for t in gpu_shapes], np.int64)
        self.whole = self.mu >= 1000
        self.per_copy = self.mu * self.num  # GPU milli one copy uses
        p = np.array([t.freq for t in gpu_shapes], np.float64)
        self.p = p / p.sum()
        self._snap_id: int | None = None

    def _bind(self, snap: Snapshot) -> None:
        if self._snap_id == snap.token:
            return
        self._snap_id = snap.token
        self.model_ok = _model_ok(self.typical, snap)
        # value[model, t]: GPU milli one copy of t uses, times its weight (0 where t cannot run).
        self.value = np.where(self.model_ok, (self.per_copy * self.p)[None, :], 0.0)
        self.inv_cpu = 1.0 / self.cpu[None, :]
        self.p_sum = float(self.p.sum())
        # Plain-Python copies for the small-set paths (numpy's per-call cost dominates there).
        self._t = range(len(self.typical))
        self._mu_l = self.mu.tolist()
        self._num_l = self.num.tolist()
        self._whole_l = self.whole.tolist()
        self._cpu_l = self.cpu.tolist()
        self._value_l = self.value.tolist()
        n, t = len(snap.node_names), len(self.typical)
        self.kg = np.zeros((n, t), np.float64)
        self.full = np.zeros(n, np.int64)
        self.idle = np.zeros(n, np.float64)
        self.node_frag = np.zeros(n, np.float64)
        self._version = np.full(n, -1, np.int64)
        self._epoch = -1

    def _kg(self, free: np.ndarray, full: np.ndarray) -> np.ndarray:
        """GPU-side copies of each shape: sum of floor(free/mu) for shares, full GPUs // num."""
        present = free >= 0
        frac = (np.where(present, free, 0)[:, :, None] // self.mu[None, None, :]).sum(axis=1)
        return np.where(self.whole[None, :], full[:, None] // self.num[None, :], frac)

    def stranded(self, models, cpu, kg, idle) -> np.ndarray:
        # Float math on purpose: these arrays are small and float ops are cheaper than int //.
        k = np.minimum(kg, np.floor(np.maximum(cpu, 0)[:, None] * self.inv_cpu + 1e-9))
        return idle * self.p_sum - (k * self.value[models]).sum(axis=1)

    # Below these sizes the plain-Python paths are faster than numpy (same results; a property
    # test holds them to each other).
    small_refresh = 8
    small_delta = 64

    def _stranded_one(self, model: int, cpu: int, kg: list, idle: float) -> float:
        value, cpu_t = self._value_l[model], self._cpu_l
        out = idle * self.p_sum
        cpu = max(cpu, 0)
        for t in self._t:
            k = kg[t]
            c = cpu // cpu_t[t]
            out -= (k if k < c else c) * value[t]
        return out

    def _kg_one(self, free: list[int], full: int) -> list[float]:
        return [
            float(full // self._num_l[t])
            if self._whole_l[t]
            else float(sum(f // self._mu_l[t] for f in free))
            for t in self._t
        ]

    def refresh(self, snap: Snapshot) -> None:
        self._bind(snap)
        stale = _stale_nodes(self, snap)
        if stale is None:
            return
        if len(stale) <= self.small_refresh:
            for n in stale.tolist():
                free = [f for f in snap.gpu_free[n].tolist() if f >= 0]
                full = sum(1 for f in free if f == 1000)
                kg = self._kg_one(free, full)
                idle = float(sum(free))
                self.full[n] = full
                self.kg[n] = kg
                self.idle[n] = idle
                self.node_frag[n] = self._stranded_one(
                    int(snap.node_model[n]), int(snap.node_cpu_free[n]), kg, idle
                )
                self._version[n] = snap.node_version[n]
            return
        free = snap.gpu_free[stale].astype(np.int64)
        full = (free == 1000).sum(axis=1)
        self.full[stale] = full
        self.kg[stale] = self._kg(free, full)
        self.idle[stale] = np.where(free >= 0, free, 0).sum(axis=1)
        self.node_frag[stale] = self.stranded(
            snap.node_model[stale], snap.node_cpu_free[stale], self.kg[stale], self.idle[stale]
        )
        self._version[stale] = snap.node_version[stale]

    def delta(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        self.refresh(snap)
        if len(cands) <= self.small_delta:
            return self._delta_small(snap, req, cands)
        shape = req.shape
        a_all, first, back = _same_outcome(snap, req, cands)
        nodes = cands.node[first]
        models = snap.node_model[nodes]
        cpu1 = snap.node_cpu_free[nodes] - shape.cpu_milli
        kg0, full0, i0 = self.kg[nodes], self.full[nodes], self.idle[nodes]
        mu, num = self.mu[None, :], self.num[None, :]
        if shape.gpus:
            full1 = full0 - shape.gpus
            kg1 = np.where(
                self.whole[None, :], full1[:, None] // num, kg0 - shape.gpus * (1000 // mu)
            )
            i1 = i0 - 1000 * shape.gpus
        elif shape.cpu_only:
            kg1, i1 = kg0, i0
        else:
            a = a_all[first][:, None]
            a1 = a - shape.gpu_milli
            full1 = full0 - (a[:, 0] == 1000)
            kg1 = np.where(self.whole[None, :], full1[:, None] // num, kg0 - a // mu + a1 // mu)
            i1 = i0 - shape.gpu_milli
        after = self.stranded(models, cpu1, kg1, i1)
        return (after - self.node_frag[nodes])[back]

    def _delta_small(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        shape = req.shape
        rows = cands.node
        kgs = self.kg[rows].tolist()
        fulls = self.full[rows].tolist()
        idles = self.idle[rows].tolist()
        frag0 = self.node_frag[rows].tolist()
        cpus = snap.node_cpu_free[rows].tolist()
        models = snap.node_model[rows].tolist()
        mu, num, whole = self._mu_l, self._num_l, self._whole_l
        frac = not (shape.gpus or shape.cpu_only)
        if frac:
            frees = snap.gpu_free[rows, np.maximum(cands.slot, 0)].tolist()
        g, m, c = shape.gpus, shape.gpu_milli, shape.cpu_milli
        out = []
        for i in range(len(rows)):
            kg0, full0 = kgs[i], fulls[i]
            if g:
                full1 = full0 - g
                kg1 = [
                    full1 // num[t] if whole[t] else kg0[t] - g * (1000 // mu[t]) for t in self._t
                ]
                idle1 = idles[i] - 1000 * g
            elif shape.cpu_only:
                kg1, idle1 = kg0, idles[i]
            else:
                a = frees[i]
                a1 = a - m
                full1 = full0 - (a == 1000)
                kg1 = [
                    full1 // num[t] if whole[t] else kg0[t] - a // mu[t] + a1 // mu[t]
                    for t in self._t
                ]
                idle1 = idles[i] - m
            out.append(self._stranded_one(models[i], cpus[i] - c, kg1, idle1) - frag0[i])
        return np.asarray(out, np.float64)
