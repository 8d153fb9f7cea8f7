"""The dynamic MIG re-layout planner (docs/design/mig-layouts.md §4): which idle GPUs to lay out
differently, given what is queued. Pure and stateless: the caller passes every GPU's layout,
whether it is idle, when it last changed and how often in the last 24 h, and the queued demand;
the planner returns decisions and changes nothing.

Rules, in order (greedy, deterministic: GPUs are taken in (node, index) order within a rank):

1. Shortfall per class = queued demand - free supply (free laid instances of that profile; idle
   whole GPUs), weighed in GPU-equivalents (memory slices / 8; a whole GPU is 1).
2. MIG shortfall and idle whole GPUs beyond the whole-GPU queue (+ `whole_reserve`): convert the
   fewest of them, each to the candidate layout that covers the most remaining shortfall (ties:
   the layout that best matches the queued mix, then the most memory laid, then the canonical
   order). GPUs on nodes that already have MIG GPUs go first, so whole nodes stay whole.
3. Whole shortfall: revert MIG GPUs with no held instance to whole GPUs, those whose free
   instances the MIG queue needs least first (then nodes with the most idle whole GPUs).
4. MIG shortfall left while fully idle MIG GPUs hold instances nobody queues for: re-lay them
   as in 2 (the mode stays on: the cheaper reset).
5. Hysteresis: a GPU that is busy, changed less than `min_dwell_s` ago, or already changed
   `max_changes_per_gpu_day` times in the last 24 h is never touched; a change is made only when
   the shortfall it covers, in GPU-equivalents x `min_dwell_s`, is at least `gain_margin` x its
   reset cost x 1 GPU; at most `max_fraction_per_cycle` of a model's GPUs (at least one) change
   per call. With no shortfall nothing changes: a GPU is never flipped back "just in case".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from app.placement.mig import PROFILES, Layout, maximal_layouts, valid_layout


@dataclass(frozen=True)
class GpuView:
    node: str
    index: int
    model: str
    layout: Layout | None  # None: MIG off (a whole GPU)
    idle: bool  # nothing runs on it: no whole allocation, no held instance
    changed_at: float = -math.inf  # when its layout last changed (seconds)
    changes_24h: int = 0
    free: Layout = ()  # laid instances nobody holds (all of them when idle)


@dataclass(frozen=True)
class Demand:
    whole: Mapping[str, int]  # GPUs wanted by queued whole-GPU work, by model
    mig: Mapping[tuple[str, str], int]  # queued MIG replicas by (model, profile key)


@dataclass(frozen=True)
class RelayoutConfig:
    reset_cost_s: float = 30.0  # [assumption] re-lay with MIG mode kept
    mode_flip_cost_s: float = 120.0  # [assumption] MIG mode on or off (a GPU reset)
    min_dwell_s: float = 7200.0
    gain_margin: float = 2.0
    max_changes_per_gpu_day: int = 4
    max_fraction_per_cycle: float = 0.05
    whole_reserve: int = 0  # idle whole GPUs per model never converted
    candidate_layouts: tuple[Layout, ...] | None = None  # default: mig.maximal_layouts()

    def layouts(self) -> tuple[Layout, ...]:
        return self.candidate_layouts or maximal_layouts()


@dataclass(frozen=True)
class Relayout:
    node: str
    index: int
    target: Layout | None  # None: back to a whole GPU
    reason: str


def _geq(key: str) -> float:
    return PROFILES[key].memory / 8


def plan(gpus: list[GpuView], demand: Demand, cfg: RelayoutConfig, now: float) -> list[Relayout]:
    """The re-layouts to make now (see the module docstring for the rules)."""
    out: list[Relayout] = []
    by_model: dict[str, list[GpuView]] = {}
    for g in gpus:
        by_model.setdefault(g.model, []).append(g)
    for model in sorted(by_model):
        out += _plan_model(model, by_model[model], demand, cfg, now)
    return out


def _plan_model(
    model: str, gpus: list[GpuView], demand: Demand, cfg: RelayoutConfig, now: float
) -> list[Relayout]:
    plan = _ModelPlan(model, gpus, demand, cfg, now)
    plan.convert_surplus_whole()  # 2.
    plan.revert_for_whole()  # 3.
    plan.relay_unwanted()  # 4.
    return plan.out


class _ModelPlan:
    """One model's GPUs planned for one cycle: the shortfall per class (1.), then the rules of
    the module's docstring in order, each spending the cycle's budget of changes."""

    def __init__(
        self, model: str, gpus: list[GpuView], demand: Demand, cfg: RelayoutConfig, now: float
    ):
        self.cfg, self.now = cfg, now
        self.gpus = sorted(gpus, key=lambda g: (g.node, g.index))
        self.budget = max(1, math.floor(cfg.max_fraction_per_cycle * len(self.gpus)))
        self.out: list[Relayout] = []
        self.touched: set[tuple[str, int]] = set()
        # 1. Shortfall per class.
        free_mig: dict[str, int] = {}
        for g in self.gpus:
            if g.layout is not None:
                for key, _start in g.free:
                    free_mig[key] = free_mig.get(key, 0) + 1
        self.queued_mig = {k: n for (m, k), n in demand.mig.items() if m == model and n > 0}
        self.short = {k: max(0, n - free_mig.get(k, 0)) for k, n in self.queued_mig.items()}
        self.idle_whole = [g for g in self.gpus if g.layout is None and g.idle]
        want_whole = demand.whole.get(model, 0)
        self.whole_short = max(0, want_whole - len(self.idle_whole))
        self.surplus = len(self.idle_whole) - want_whole - cfg.whole_reserve
        total_queued = sum(self.queued_mig.values()) or 1
        self.mix = {k: n / total_queued for k, n in self.queued_mig.items()}
        self.mig_nodes: dict[str, int] = {}
        for g in self.gpus:
            if g.layout is not None:
                self.mig_nodes[g.node] = self.mig_nodes.get(g.node, 0) + 1
        self.idle_mig = [g for g in self.gpus if g.layout is not None and self.movable(g)]

    def movable(self, g: GpuView) -> bool:
        return (
            g.idle
            and self.now - g.changed_at >= self.cfg.min_dwell_s
            and g.changes_24h < self.cfg.max_changes_per_gpu_day
        )

    def worth(self, covered_geq: float, cost_s: float) -> bool:
        return covered_geq * self.cfg.min_dwell_s >= self.cfg.gain_margin * cost_s

    def best_layout(self) -> tuple[Layout, float] | None:
        best: tuple[tuple[float, float, float], Layout] | None = None
        for layout in self.cfg.layouts():
            counts: dict[str, int] = {}
            for key, _s in layout:
                counts[key] = counts.get(key, 0) + 1
            covered = sum(min(c, self.short.get(k, 0)) * _geq(k) for k, c in counts.items())
            if covered <= 0:
                continue
            fit = sum(self.mix.get(k, 0.0) * _geq(k) for k, _s in layout)
            laid = sum(_geq(k) for k, _s in layout)
            score = (covered, fit, laid)
            if best is None or score > best[0]:  # strict: the first in canonical order wins ties
                best = (score, layout)
        return None if best is None else (best[1], best[0][0])

    def take(self, layout: Layout) -> None:
        for key, _s in layout:
            if self.short.get(key, 0) > 0:
                self.short[key] -= 1

    def convert_surplus_whole(self) -> None:
        """2. Convert idle whole GPUs beyond the whole queue."""
        if not any(self.short.values()) or self.surplus <= 0:
            return
        order = sorted(
            (g for g in self.idle_whole if self.movable(g)),
            key=lambda g: (-self.mig_nodes.get(g.node, 0), g.node, g.index),
        )
        for g in order:
            if self.budget <= 0 or self.surplus <= 0 or not any(self.short.values()):
                break
            pick = self.best_layout()
            if pick is None or not self.worth(pick[1], self.cfg.mode_flip_cost_s):
                break
            layout, covered = pick
            assert valid_layout(list(layout))
            self.out.append(
                Relayout(g.node, g.index, layout, f"MIG shortfall {covered:.3g} GPU-eq")
            )
            self.take(layout)
            self.mig_nodes[g.node] = self.mig_nodes.get(g.node, 0) + 1
            self.surplus -= 1
            self.budget -= 1

    def revert_for_whole(self) -> None:
        """3. Revert fully idle MIG GPUs for a whole-GPU shortfall."""
        if self.whole_short <= 0 or not self.worth(1.0, self.cfg.mode_flip_cost_s):
            return
        idle_whole_on: dict[str, int] = {}
        for g in self.idle_whole:
            idle_whole_on[g.node] = idle_whole_on.get(g.node, 0) + 1

        def needed(g: GpuView) -> float:
            assert g.layout is not None
            return sum(_geq(k) for k, _s in g.layout if self.queued_mig.get(k, 0) > 0)

        for g in sorted(
            self.idle_mig,
            key=lambda g: (needed(g), -idle_whole_on.get(g.node, 0), g.node, g.index),
        ):
            if self.budget <= 0 or self.whole_short <= 0:
                break
            self.out.append(Relayout(g.node, g.index, None, "whole-GPU shortfall"))
            self.touched.add((g.node, g.index))
            idle_whole_on[g.node] = idle_whole_on.get(g.node, 0) + 1
            self.whole_short -= 1
            self.budget -= 1

    def relay_unwanted(self) -> None:
        """4. Re-lay fully idle MIG GPUs whose instances nobody queues for."""
        for g in self.idle_mig:
            if self.budget <= 0 or not any(self.short.values()):
                break
            assert g.layout is not None
            if (g.node, g.index) in self.touched or any(self.short.get(k, 0) for k, _s in g.layout):
                continue  # its own instances are wanted: keep it as it is
            pick = self.best_layout()
            if pick is None or not self.worth(pick[1], self.cfg.reset_cost_s):
                continue
            if pick[0] == g.layout:
                continue
            layout, covered = pick
            self.out.append(
                Relayout(g.node, g.index, layout, f"profile mismatch {covered:.3g} GPU-eq")
            )
            self.take(layout)
            self.budget -= 1
