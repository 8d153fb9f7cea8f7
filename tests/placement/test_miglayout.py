"""The MIG re-layout planner (app/placement/miglayout.py): what it converts, reverts and re-lays,
and the hysteresis that keeps it from flapping."""

from __future__ import annotations

import random

import pytest

from app.placement.mig import maximal_layouts, valid_layout
from app.placement.miglayout import Demand, GpuView, RelayoutConfig, plan

pytestmark = pytest.mark.no_db

M = "H100-80GB"
BAL = (("1g", 0), ("1g", 1), ("2g", 2), ("3g", 4))
ONES = tuple(("1g", s) for s in range(7))
NOW = 100_000.0
CFG = RelayoutConfig()


def whole(node: str, i: int, idle: bool = True, **kw) -> GpuView:
    return GpuView(node, i, M, None, idle, **kw)


def laid(node: str, i: int, layout=BAL, held: int = 0, **kw) -> GpuView:
    return GpuView(node, i, M, layout, held == 0, free=layout[held:], **kw)


def fleet(n_whole: int, n_mig: int = 0, layout=BAL, **kw) -> list[GpuView]:
    return [whole(f"n{i // 8}", i % 8, **kw) for i in range(n_whole)] + [
        laid(f"m{i // 8}", i % 8, layout, **kw) for i in range(n_mig)
    ]


def test_maximal_layouts_are_valid_and_maximal():
    layouts = maximal_layouts()
    assert BAL in layouts and ONES in layouts
    assert all(valid_layout(list(lay)) for lay in layouts)
    assert len(set(layouts)) == len(layouts) and 10 < len(layouts) < 200


@pytest.mark.parametrize(
    "case, gpus, demand, expect",
    [
        # A MIG backlog and idle whole GPUs nobody queues for: convert, as few as cover it.
        ("mig backlog converts", fleet(40), Demand({}, {(M, "3g"): 4}), {"mig": 2, "whole": 0}),
        ("1g backlog converts one", fleet(40), Demand({}, {(M, "1g"): 7}), {"mig": 1, "whole": 0}),
        # The whole-GPU queue keeps its idle GPUs.
        (
            "whole queue keeps GPUs",
            fleet(4),
            Demand({M: 4}, {(M, "3g"): 4}),
            {"mig": 0, "whole": 0},
        ),
        # A whole backlog and fully idle MIG GPUs: revert.
        ("whole backlog reverts", fleet(0, 80), Demand({M: 3}, {}), {"mig": 0, "whole": 3}),
        # Free instances cover the MIG queue: nothing to do.
        ("supply covers", fleet(8, 8), Demand({}, {(M, "3g"): 8}), {"mig": 0, "whole": 0}),
        # No demand at all: no flapping back to anything.
        ("no demand", fleet(20, 20), Demand({}, {}), {"mig": 0, "whole": 0}),
    ],
)
def test_decisions(case, gpus, demand, expect):
    out = plan(gpus, demand, CFG, NOW)
    got = {
        "mig": sum(r.target is not None for r in out),
        "whole": sum(r.target is None for r in out),
    }
    assert got == expect, case
    for r in out:
        if r.target is not None:
            assert valid_layout(list(r.target))


def test_converted_layout_covers_the_queued_profile():
    (r,) = plan(fleet(40), Demand({}, {(M, "4g"): 1}), CFG, NOW)
    assert r.target is not None and ("4g", 0) in r.target


def test_profile_mismatch_relays_idle_mig_gpus():
    gpus = fleet(0, 20, layout=ONES)  # 7 x 1g each; the queue wants 3g
    out = plan(gpus, Demand({}, {(M, "3g"): 2}), CFG, NOW)
    assert len(out) == 1 and out[0].target is not None and ("3g", 0) in out[0].target


@pytest.mark.parametrize(
    "kw",
    [
        {"idle": False},  # busy
        {"changed_at": NOW - 600},  # changed 10 minutes ago: in its dwell
        {"changes_24h": 4},  # at the daily cap
    ],
)
def test_never_touches_busy_dwelling_or_capped_gpus(kw):
    assert plan(fleet(40, **kw), Demand({}, {(M, "3g"): 10}), CFG, NOW) == []
    mig = [
        laid(
            "m0",
            i,
            changed_at=kw.get("changed_at", -1e18),
            changes_24h=kw.get("changes_24h", 0),
            held=1 if kw.get("idle") is False else 0,
        )
        for i in range(8)
    ]
    assert plan(mig, Demand({M: 8}, {}), CFG, NOW) == []


def test_partly_held_mig_gpu_is_not_reverted():
    gpus = [laid("m0", 0, held=1), laid("m0", 1, held=0)]
    out = plan(gpus, Demand({M: 2}, {}), CFG, NOW)
    assert [(r.node, r.index, r.target) for r in out] == [("m0", 1, None)]


def test_at_most_a_fraction_per_cycle():
    gpus = fleet(200)
    out = plan(gpus, Demand({}, {(M, "1g"): 1000}), CFG, NOW)
    assert len(out) == 10  # 5 % of 200
    out = plan(fleet(0, 200), Demand({M: 1000}, {}), CFG, NOW)
    assert len(out) == 10
    assert len(plan(fleet(10), Demand({}, {(M, "1g"): 1000}), CFG, NOW)) == 1  # at least one


def test_gain_margin_against_reset_cost():
    # One 1g queued (1/8 GPU) for a 2 h dwell easily pays a 120 s reset at margin 2...
    assert plan(fleet(8), Demand({}, {(M, "1g"): 1}), CFG, NOW)
    # ... not when the reset costs more than the gain.
    dear = RelayoutConfig(mode_flip_cost_s=3600.0)
    assert plan(fleet(8), Demand({}, {(M, "1g"): 1}), dear, NOW) == []


def test_whole_reserve_is_kept():
    cfg = RelayoutConfig(whole_reserve=8)
    assert plan(fleet(8), Demand({}, {(M, "3g"): 4}), cfg, NOW) == []
    assert len(plan(fleet(9), Demand({}, {(M, "3g"): 4}), cfg, NOW)) == 1


def test_deterministic_and_prefers_nodes_with_mig_gpus():
    gpus = fleet(16) + [laid("n1", 7, held=1)]
    gpus = [g for g in gpus if not (g.node == "n1" and g.index == 7 and g.layout is None)]
    a = plan(gpus, Demand({}, {(M, "3g"): 4}), CFG, NOW)
    assert a == plan(list(reversed(gpus)), Demand({}, {(M, "3g"): 4}), CFG, NOW)
    assert all(r.node == "n1" for r in a)


def test_no_flapping_when_demand_is_met():
    """Apply the decisions call after call until the queue is covered; from then on, with the
    same (met) queue or none, no call changes anything, however much later."""
    gpus = {(g.node, g.index): g for g in fleet(24)}
    demand = Demand({}, {(M, "3g"): 4, (M, "2g"): 2})
    t = NOW
    for _ in range(10):
        out = plan(list(gpus.values()), demand, CFG, t)
        if not out:
            break
        for r in out:
            lay = r.target
            gpus[(r.node, r.index)] = GpuView(r.node, r.index, M, lay, True, t, 1, lay or ())
        t += 300
    else:
        pytest.fail("the planner never settled")
    assert sum(g.layout is not None for g in gpus.values()) == 3  # 3g+3g twice, then the 2g's
    for later in (t, t + 3 * 3600, t + 48 * 3600):
        assert plan(list(gpus.values()), demand, CFG, later) == []
        assert plan(list(gpus.values()), Demand({}, {}), CFG, later) == []


def test_property_every_target_is_valid_and_rules_hold():
    rng = random.Random(7)
    layouts = maximal_layouts()
    keys = ("1g", "1g.2m", "2g", "3g", "4g")
    for _ in range(300):
        gpus = []
        for i in range(rng.randint(1, 64)):
            node, idx = f"n{i // 8:02d}", i % 8
            changed = NOW - rng.choice([60, 3600, 8000, 1e9])
            changes = rng.randint(0, 5)
            if rng.random() < 0.5:
                gpus.append(
                    whole(node, idx, rng.random() < 0.6, changed_at=changed, changes_24h=changes)
                )
            else:
                lay = rng.choice(layouts)
                held = rng.randint(0, len(lay)) if rng.random() < 0.5 else 0
                gpus.append(laid(node, idx, lay, held, changed_at=changed, changes_24h=changes))
        demand = Demand(
            {M: rng.randint(0, 10)},
            {(M, k): rng.randint(0, 12) for k in keys if rng.random() < 0.6},
        )
        out = plan(gpus, demand, CFG, NOW)
        by = {(g.node, g.index): g for g in gpus}
        assert len({(r.node, r.index) for r in out}) == len(out)
        assert len(out) <= max(1, int(0.05 * len(gpus)))
        for r in out:
            g = by[(r.node, r.index)]
            assert g.idle and NOW - g.changed_at >= CFG.min_dwell_s and g.changes_24h < 4
            assert r.target is None or valid_layout(list(r.target))
            assert r.target != g.layout
