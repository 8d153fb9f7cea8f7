"""The classic heuristics: first-fit, best-fit, spread (worst-fit), GPU packing."""

from __future__ import annotations

import numpy as np

from app.placement.engine import FRAC_SHARED, MIG_SHARED, Candidates
from app.placement.model import Request
from app.placement.policies.base import Policy, cpu_after, gpu_after, gpu_free_at
from app.placement.snapshot import Snapshot

# The published best-fit normalises by the largest node spec (128 cores, 8 GPUs).
MAX_CPU = 128_000
MAX_GPU = 8_000


class FirstFit(Policy):
    """The first node in fleet order that fits, then the lowest GPU index."""

    name = "first-fit"

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        return cands.node * 64.0 + np.maximum(cands.slot, 0)


class BestFit(Policy):
    """Least CPU and GPU left on the node after placement (0.5/0.5 weights, as published),
    min-max normalised to 0..100 and truncated, ties at random; inside the node, the fitting
    GPU with the least free milli."""

    name = "best-fit"
    random_ties = True

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        left = (
            0.5 * cpu_after(snap, req, cands) / MAX_CPU
            + 0.5 * gpu_after(snap, req, cands) / MAX_GPU
        )
        node_score = (1.0 - left) * 100
        lo, hi = node_score.min(), node_score.max()
        norm = np.zeros_like(node_score) if hi - lo < 1e-12 else (node_score - lo) * 100 / (hi - lo)
        # Integer node score dominates; the GPU's free milli breaks ties inside a node.
        return -np.floor(norm) + gpu_free_at(snap, cands) / 1e5


class Spread(Policy):
    """Most resources left after placement (worst fit): spreads load, keeps headroom."""

    name = "spread"

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        left = (
            0.5 * cpu_after(snap, req, cands) / MAX_CPU
            + 0.5 * gpu_after(snap, req, cands) / MAX_GPU
        )
        return -left + cands.node * 1e-12


class GpuPacking(Policy):
    """Prefer already-shared GPUs (fullest first), then used nodes, then empty ones."""

    name = "gpu-packing"
    random_ties = True

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        shared = (cands.kind == FRAC_SHARED) | (cands.kind == MIG_SHARED)
        free = gpu_free_at(snap, cands)
        rows = snap.gpu_free[cands.node]
        node_free = np.where(rows >= 0, rows, 0).sum(axis=1)
        node_cap = snap.node_ngpu[cands.node] * 1000
        used_node = node_free < node_cap
        free_gpus = (snap.gpu_free[cands.node] == 1000).sum(axis=1)
        score = np.where(
            shared, 100 - free / 10 / 2, np.where(used_node, 50 - free_gpus, 33 - free_gpus)
        )
        return -np.floor(score) + free / 1e5
