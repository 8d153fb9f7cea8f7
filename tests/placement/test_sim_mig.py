"""`rackplane sim mig` (rackplane_bench/sim/mig.py): a tiny run, and the properties it must keep
whatever the figures: served within what was offered, static layouts never reset, the dynamic
planner's dwell holds in the replay."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

from app.placement.miglayout import RelayoutConfig
from rackplane_bench.sim import mig

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
OPENB = TRACES / "openb" / "openb_pod_list_default.csv"
PHILLY = TRACES / "philly" / "philly_jobs.csv"
pytestmark = [
    pytest.mark.no_db,
    pytest.mark.skipif(not OPENB.exists(), reason="public traces not present"),
]

P = mig.Params(nodes=2, days=1.0, warmup_days=0.25, seed=3)
CFG = RelayoutConfig(min_dwell_s=1800.0)


@pytest.fixture(scope="module")
def trace():
    return mig.build_trace(OPENB, PHILLY, P)


def test_profile_rule_reproduces_the_memo_counts():
    with open(OPENB, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["num_gpu"] == "1" and int(r["gpu_milli"]) < 1000]
    counts = Counter(mig.profile_of(int(r["gpu_milli"])) for r in rows)
    assert counts == {"1g": 106, "2g": 548, "3g": 946, "4g": 147, None: 1331}
    with pytest.raises(ValueError):
        mig.profile_of(500, "nope")


def test_trace_follows_the_day_shape(trace):
    assert trace.items and all(0 <= it.at < P.days * mig.DAY for it in trace.items)
    assert {it.kind for it in trace.items} == {"mig", "whole-inference", "training"}
    # MIG's share of the offered work is higher around the 14:00 peak than around 02:00.
    share = trace.mig_share_by_hour
    assert sum(share[12:17]) > sum(share[0:5])


@pytest.mark.parametrize(
    "policy, fraction",
    [("static-none", 0.0), ("static-1g", 0.5), ("static-balanced", 0.5), ("dynamic", 0.5)],
)
def test_served_within_offered_and_static_never_resets(trace, policy, fraction):
    r = mig.replay(trace, policy, fraction, P, CFG)
    d = r.as_dict()
    window_h = (P.days - P.warmup_days) * 24
    assert 0 < r.served_gpu_s <= r.offered_gpu_s + r.carried_in_gpu_s + 1e-6
    assert d["demand_served_gpu_hours"] <= r.gpus * window_h + 1e-6
    for kind, s in r.served_by_kind.items():
        assert s <= r.offered_by_kind.get(kind, 0.0) + r.carried_in_gpu_s + 1e-6
    if policy.startswith("static"):
        assert r.resets == 0 and d["resets_per_gpu_day"] == 0 and not r.changes
    if policy == "static-none":
        assert "mig" not in r.served_by_kind and r.dropped_inference > 0


def test_dynamic_respects_dwell_and_daily_cap(trace):
    r = mig.replay(trace, "dynamic", 0.5, P, CFG)
    assert r.changes, "the tiny run should re-lay something"
    for times in r.changes.values():
        assert all(b - a >= CFG.min_dwell_s for a, b in zip(times, times[1:], strict=False))
        for t in times:
            assert sum(1 for x in times if t - mig.DAY < x <= t) <= CFG.max_changes_per_gpu_day
    assert r.resets <= sum(len(v) for v in r.changes.values())


def test_deterministic(trace):
    a = mig.replay(trace, "dynamic", 0.5, P, CFG).as_dict()
    b = mig.replay(trace, "dynamic", 0.5, P, CFG).as_dict()
    a.pop("seconds"), b.pop("seconds")
    assert a == b
