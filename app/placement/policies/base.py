"""Policy protocol: score candidates (lower is better) and pick one."""

from __future__ import annotations

import numpy as np

from app.placement.engine import CPU_ONLY, WHOLE, Candidates
from app.placement.model import Request
from app.placement.snapshot import Snapshot


class Policy:
    """A named placement policy. Subclasses implement `score`.

    `candidate_limit`: None asks the engine for every feasible candidate (exhaustive
    policies); a number bounds how many the indexes hand over per source (fast at scale).
    `random_ties`: among the best nodes pick the first in a fixed random order of the fleet
    (drawn once from the seed). The published simulator behaves this way: nodes carry random
    name prefixes and the first best node in name order wins; a fresh coin flip per decision
    scatters load and measured 5 points worse for FGD on openb. Without it the first
    candidate in index order wins.
    """

    name = "base"
    candidate_limit: int | None = None
    random_ties = False
    perf_weight = 1e4
    health_weight = 1e4
    # Work that runs at one GPU's pace (one GPU, a share, a MIG slice) goes to slower GPUs
    # first, keeping fast ones whole for gangs: a bonus per unit of slowness (a preference
    # among candidates, below the policy's packing scores' usual spread).
    slow_first_weight = 100.0
    gang_group_tries = 16
    # Cost added for landing single work in an empty multi-node NVLink domain (scaled by how
    # empty it is); 0 turns the topology scorer off.
    topology_weight = 500.0
    _ranks: np.ndarray | None = None

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def score(self, snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
        raise NotImplementedError

    def pick(self, scores: np.ndarray, cands: Candidates, snap: Snapshot | None = None) -> int:
        best = scores.min()
        ties = np.flatnonzero(scores <= best + 1e-9)
        if len(ties) == 1 or not self.random_ties:
            return int(ties[0])
        rank = self._rank(len(snap.node_names) if snap is not None else int(cands.node.max()) + 1)
        # The best-ranked tied node; inside it the first candidate (lowest GPU index).
        node = cands.node[ties][np.argmin(rank[cands.node[ties]])]
        return int(ties[cands.node[ties] == node][0])

    def _rank(self, n: int) -> np.ndarray:
        if self._ranks is None or len(self._ranks) < n:
            order = self.rng.permutation(n)
            self._ranks = np.empty(n, np.int64)
            self._ranks[order] = np.arange(n)
        return self._ranks


def gpu_after(snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
    """Free GPU milli left on each candidate's node after placing the replica there."""
    rows = snap.gpu_free[cands.node]
    free = np.where(rows >= 0, rows, 0).sum(axis=1)
    shape = req.shape
    need = shape.gpus * 1000 if shape.gpus else shape.gpu_milli
    return free - np.where(cands.kind == CPU_ONLY, 0, need)


def cpu_after(snap: Snapshot, req: Request, cands: Candidates) -> np.ndarray:
    return snap.node_cpu_free[cands.node] - req.shape.cpu_milli


def gpu_free_at(snap: Snapshot, cands: Candidates) -> np.ndarray:
    """Free milli on the candidate's GPU (whole-GPU candidates: 1000)."""
    slot = np.maximum(cands.slot, 0)
    return np.where(
        (cands.kind == WHOLE) | (cands.kind == CPU_ONLY), 1000, snap.gpu_free[cands.node, slot]
    )
