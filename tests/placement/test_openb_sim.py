"""The openb replay harness on small generated traces (the full traces run in benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.placement.engine import Engine, Plan
from app.placement.model import Shape
from app.placement.policies import POLICIES, make_policy
from app.placement.snapshot import NodeSpec, Snapshot
from rackplane_bench.sim import openb
from rackplane_bench.sim.openb_bound import online_bound

pytestmark = pytest.mark.no_db

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "\n".join(
    f"n{i:03d},{64000 if i % 2 else 96000},262144,{8 if i % 3 else 2},{'G2' if i % 3 else 'T4'}"
    for i in range(30)
)


def _pods(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    rows = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec"]
    for i in range(n):
        kind = rng.choice(["frac", "one", "multi", "cpu"], p=[0.4, 0.4, 0.1, 0.1])
        if kind == "frac":
            g, m = 1, int(rng.choice([250, 470, 810]))
        elif kind == "one":
            g, m = 1, 1000
        elif kind == "multi":
            g, m = int(rng.choice([2, 4, 8])), 1000
        else:
            g, m = 0, 0
        spec = "T4" if rng.random() < 0.05 else ""
        rows.append(f"p{i:04d},{int(rng.choice([2000, 4000, 8000]))},8192,{g},{m},{spec}")
    return "\n".join(rows) + "\n"


@pytest.fixture
def trace(tmp_path):
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text(_pods(100))
    return tmp_path


def test_arrival_sequence_follows_the_protocol(trace):
    pods = openb.load_pods(trace / "pods.csv")
    assert [p.name for p in pods] == sorted(p.name for p in pods)
    cap = sum(n.gpus for n in openb.load_nodes(trace / "nodes.csv")) * 1000
    seq = openb.arrival_sequence(pods, cap, seed=42)
    assert sorted(p.name for p in seq[: len(pods)]) == [p.name for p in pods]  # a permutation
    total = sum(p.total_milli for p in seq)
    assert 1.25 * cap < total <= 1.3 * cap + 8000
    assert openb.arrival_sequence(pods, cap, seed=42) == seq  # deterministic per seed
    assert openb.arrival_sequence(pods, cap, seed=43) != seq


@pytest.mark.parametrize("policy", ["fgd", "best-fit", "rackplane", "first-fit"])
def test_replay_accounts_for_every_pod(trace, policy):
    nodes, pods = openb.load_nodes(trace / "nodes.csv"), openb.load_pods(trace / "pods.csv")
    r = openb.replay(nodes, pods, policy, seed=1)
    assert r.placed + r.dropped == r.pods
    assert 50 < r.alloc_pct_at_130 <= 100
    assert 0 <= r.frag_ratio_at_90 <= 100


def test_gpu_spec_constraints_are_honoured(trace):
    nodes, pods = openb.load_nodes(trace / "nodes.csv"), openb.load_pods(trace / "pods.csv")
    snap = Snapshot(nodes)
    from app.placement.engine import Engine, Plan
    from app.placement.policies import make_policy

    engine = Engine(
        snap,
        make_policy("rackplane", typical=openb.typical_shapes([p.shape for p in pods])),
        allow_mig_reconfigure=False,
    )
    plan = Plan(snap)
    for i, pod in enumerate(pods):
        out = engine.place_one(openb.request_of(pod, i), plan)
        if out.placed and pod.shape.models:
            assert (
                snap.model_names[snap.node_model[snap.node_index[out.bindings[0].node]]]
                in pod.shape.models
            )


def test_bound_is_an_upper_bound(trace):
    nodes, pods = openb.load_nodes(trace / "nodes.csv"), openb.load_pods(trace / "pods.csv")
    bound = openb.physical_bound(nodes, pods, seed=1)
    assert bound.pct <= bound.offline_pct + 1e-6
    for policy in ("fgd", "rackplane"):
        assert openb.replay(nodes, pods, policy, seed=1).alloc_pct_at_130 <= bound.pct + 1e-6


def test_cli_prints_one_json_object_per_run_and_the_mean(trace):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "sim",
            "openb",
            "--nodes",
            str(trace / "nodes.csv"),
            "--pods",
            str(trace / "pods.csv"),
            "--policy",
            "fgd",
            "--seeds",
            "1-3",
            "--json",
            "--bound",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["seed"] for x in lines[:3]] == [1, 2, 3]
    for x in lines[:3]:
        assert {
            "policy",
            "seed",
            "alloc_pct_at_130",
            "frag_ratio_at_90",
            "placed",
            "dropped",
            "seconds",
        } <= set(x)
        assert x["alloc_pct_at_130"] <= x["bound_pct_at_130"] <= x["offline_bound_pct_at_130"]
        assert x["bound_converged"] is True
    mean = lines[3]
    assert "mean_bound_pct_at_130" in mean
    assert mean["mean_alloc_pct_at_130"] == pytest.approx(
        sum(x["alloc_pct_at_130"] for x in lines[:3]) / 3, abs=1e-3
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "sim",
            "openb",
            "--policy",
            "nope",
            "--nodes",
            str(trace / "nodes.csv"),
            "--pods",
            str(trace / "pods.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown policy" in bad.stderr


def _fleet(spec: list[tuple[int, int]]) -> list[NodeSpec]:
    return [
        NodeSpec(f"n{i}", "G2", gpus=g, cpu_milli=cpu, mem_mib=65536, region="openb")
        for i, (g, cpu) in enumerate(spec)
    ]


def _pod(i: int, *, gpus: int = 0, milli: int = 0, cpu: int = 1000) -> openb.Pod:
    return openb.Pod(f"p{i:04d}", Shape(gpus=gpus, milli=milli, cpu_milli=cpu, mem_mib=1024))


def test_arrival_sequence_refuses_pods_that_never_fill_the_fleet():
    with pytest.raises(ValueError, match="no pod asks for a GPU"):
        openb.arrival_sequence([_pod(0), _pod(1)], 8000, seed=1)


def test_bound_sees_big_shares_that_must_be_placed():
    """Eight 810-milli shares arrive before eight whole-GPU pods on 8 GPUs: any policy must put
    each share on a GPU of its own, so no whole GPU is left and 81% is all anyone reaches. A
    scheduler that could refuse the shares would reach 100%, which is what the offline
    relaxation says."""
    nodes = _fleet([(2, 16000)] * 4)
    seq = [_pod(i, milli=810) for i in range(8)] + [_pod(8 + i, gpus=1) for i in range(8)]
    b = online_bound(nodes, seq)
    assert b.offline_pct == pytest.approx(100.0)
    assert b.pct == pytest.approx(81.0)
    assert b.first_drop_pct is None and b.converged
    snap = Snapshot(nodes)
    engine = Engine(snap, make_policy("fgd", seed=1), allow_mig_reconfigure=False)
    plan = Plan(snap)
    placed = [engine.place_one(openb.request_of(p, i), plan).placed for i, p in enumerate(seq)]
    assert placed == [True] * 8 + [False] * 8


def test_bound_counts_the_holes_small_shares_can_fill():
    """On one GPU, a 150-milli share fits next to an 810-milli one, a 400-milli share does not."""
    nodes = _fleet([(1, 16000)])
    seq = [_pod(0, milli=810), _pod(1, milli=400), _pod(2, milli=150)]
    b = online_bound(nodes, seq)
    assert b.pct == pytest.approx(96.0)
    assert b.offline_pct == pytest.approx(100.0)  # 400 + 150 and the 810 refused


_SHAPES = st.sampled_from(
    [
        {"milli": 810},
        {"milli": 810},
        {"milli": 650},
        {"milli": 400},
        {"milli": 180},
        {"gpus": 1},
        {"gpus": 1},
        {"gpus": 2},
        {"gpus": 4},
        {},
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fleet=st.lists(
        st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([8000, 16000, 64000])),
        min_size=1,
        max_size=5,
    ),
    shapes=st.lists(
        st.tuples(_SHAPES, st.sampled_from([1000, 3000, 6000, 12000])), min_size=1, max_size=60
    ),
    seed=st.integers(0, 3),
)
def test_no_policy_beats_the_bound(fleet, shapes, seed):
    nodes = _fleet(fleet)
    pods = [_pod(i, cpu=cpu, **shape) for i, (shape, cpu) in enumerate(shapes)]
    pods.append(_pod(len(pods), milli=810))  # demand must be able to reach the capacity
    b = openb.physical_bound(nodes, pods, seed)
    assert b.pct <= b.offline_pct + 1e-6
    for policy in POLICIES:
        assert openb.replay(nodes, pods, policy, seed).alloc_pct_at_130 <= b.pct + 1e-6, policy
