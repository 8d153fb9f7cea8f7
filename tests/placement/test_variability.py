"""Variability-aware placement: per-GPU speed in the snapshot; gangs keep to fast GPUs of one
class, work at one GPU's pace takes slow GPUs first."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.placement.engine import Engine
from app.placement.policies import POLICIES, make_policy
from rackplane_bench.sim.variability import gangs, mark_slow
from tests.fixtures.snapshots import node, share, snap, whole

pytestmark = pytest.mark.no_db

SLOW = (1.0, 1.0, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0)


def slow_node(name: str, **kw):
    return replace(node(name, 8, **kw), gpu_perf=SLOW)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_gang_avoids_a_node_with_a_slow_gpu_while_clean_ones_fit(policy):
    s = snap(slow_node("a", rack="r"), node("b", 8, rack="r"), node("c", 8, rack="r"))
    plan = Engine(s, make_policy(policy, seed=1)).place([whole("g", 8, replicas=2)])
    assert {b.node for b in plan.bindings} == {"b", "c"}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_single_gpu_work_and_shares_take_the_slow_gpu_first(policy):
    s = snap(slow_node("a"))
    plan = Engine(s, make_policy(policy, seed=1)).place([whole("x", 1), share("y", 500)])
    assert plan.bindings[0].gpu_indices == (2,)
    # The share goes to a fresh GPU: the slow one is taken, so the slowest left (any of them).
    assert plan.bindings[1].gpu_indices != (2,)


def test_a_multi_gpu_replica_takes_the_fastest_gpus_of_a_node():
    s = snap(slow_node("a"))
    plan = Engine(s, make_policy("first-fit")).place([whole("x", 4)])
    assert 2 not in plan.bindings[0].gpu_indices


def test_a_gang_keeps_one_performance_class_by_its_gpus_not_its_node():
    # Every node has one slow GPU: 7-GPU replicas fit on the fast ones of each.
    s = snap(slow_node("a", rack="r"), slow_node("b", rack="r"))
    plan = Engine(s, make_policy("first-fit")).place([whole("g", 7, replicas=2)])
    assert plan.outcomes[0].placed
    assert all(2 not in b.gpu_indices for b in plan.bindings)


def test_slow_marks_are_five_percent_and_deterministic():
    nodes = [node(f"n{i}", 8) for i in range(100)]
    marked, slow = mark_slow(nodes, 7)
    assert len(slow) == 40 and mark_slow(nodes, 7)[1] == slow
    assert sum(g < 1 for n in marked for g in (n.gpu_perf or ())) == 40


def test_the_variability_benchmark_keeps_gangs_off_slow_gpus_where_blind_does_not():
    r = gangs(nodes=256, seed=1)
    assert r["gangs_placed_aware"] == r["gangs_placed_blind"] > 5
    assert r["gangs_on_slow_pct_aware"] < 5 < 50 < r["gangs_on_slow_pct_blind"]
