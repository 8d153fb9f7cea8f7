"""Property-based tests of the placement core's invariants over random request streams."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.placement.engine import Engine
from app.placement.isolation import GPU_SHARE, TIERS, Share, Tier, Unit
from app.placement.mig import valid_layout
from app.placement.model import Level, Request, Shape, Topology
from app.placement.policies import POLICIES, make_policy
from app.placement.snapshot import Snapshot
from tests.fixtures.snapshots import hgx, node, nvl72

pytestmark = pytest.mark.no_db

TENANTS = ["ta", "tb", "tc"]
PROFILE_KEYS = ["1g", "1g.2m", "2g", "3g", "4g", "7g"]


def fleet() -> Snapshot:
    nodes = (
        nvl72("nvl", block="b1")
        + hgx("h", 3, rack="hr", block="b1", mig=(6, 7))
        + [node("a100", 8, "A100-80GB", mig=(0, 1, 2, 3)), node("t4", 2, "T4")]
    )
    return Snapshot(nodes)


@st.composite
def requests(draw, i: int = 0):
    tier = draw(st.sampled_from(list(Tier)))
    unit = TIERS[tier].unit
    tenant = draw(st.sampled_from(TENANTS))
    if unit is Unit.FRACTION:
        shape = Shape(
            milli=draw(st.integers(1, 999)),
            gpu_mem_mib=draw(st.integers(0, 40_000)),
            cpu_milli=draw(st.integers(0, 8000)),
        )
    elif unit is Unit.MIG:
        shape = Shape(mig=draw(st.sampled_from(PROFILE_KEYS)), cpu_milli=draw(st.integers(0, 8000)))
    else:
        sizes = [1, 2, 4, 8] if tier in (Tier.VM, Tier.CONFIDENTIAL_VM) else [1, 2, 3, 4, 8]
        shape = Shape(gpus=draw(st.sampled_from(sizes)), cpu_milli=draw(st.integers(0, 30_000)))
    replicas = draw(st.sampled_from([1, 1, 1, 2, 4, 9]))
    topo = None
    if replicas > 1 and draw(st.booleans()):
        topo = Topology(draw(st.sampled_from(list(Level))), draw(st.booleans()))
    return Request(f"r{i}-{draw(st.integers(0, 10**9))}", tenant, tier, shape, replicas, topo)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("place"), requests()),
        st.tuples(st.just("release"), st.integers(0, 10**6)),
        st.tuples(st.just("what-if"), requests()),
    ),
    min_size=1,
    max_size=40,
)


def check_invariants(s: Snapshot) -> None:
    present = s.gpu_present
    assert (s.gpu_free[present] >= 0).all() and (s.gpu_free[present] <= 1000).all()
    assert (s.gpu_mem_free[present] >= 0).all()
    assert (s.node_cpu_free >= 0).all() and (s.node_mem_free >= 0).all()
    by_gpu: dict[tuple[int, int], list] = {}
    for a in s.allocs.values():
        for slot in a.slots:
            by_gpu.setdefault((a.node, slot), []).append(a)
    for (n, slot), allocs in by_gpu.items():
        # MIG layouts valid for the geometry.
        migs = [(a.mig, a.mig_start) for a in allocs if a.mig]
        if migs:
            assert s.gpu_mig[n, slot] and valid_layout(migs)
        # Milli accounting exact.
        used = sum(
            1000
            if not a.milli and not a.mig
            else (
                a.milli
                or {"1g": 125, "1g.2m": 250, "2g": 250, "3g": 500, "4g": 500, "7g": 1000}[a.mig]
            )
            for a in allocs
        )
        assert 1000 - used == s.gpu_free[n, slot]
        # The isolation table is never violated, pairwise.
        for x, y in itertools.combinations(allocs, 2):
            rule = GPU_SHARE[(x.tier, y.tier)]
            assert rule is Share.ANY_TENANT or (
                rule is Share.SAME_TENANT and x.tenant == y.tenant
            ), (x, y)
    # A whole-node confidential VM is alone on its node.
    for a in s.allocs.values():
        if a.whole_node:
            assert all(b.node != a.node or b is a for b in s.allocs.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(sorted(POLICIES)))
def test_invariants_hold_over_random_streams(ops, policy):
    s = fleet()
    engine = Engine(s, make_policy(policy, seed=7))
    plan = None
    for op, arg in ops:
        if op == "place":
            plan = engine.place([arg], plan)
            out = plan.outcomes[-1]
            # All or nothing: a placed request has every replica, an unplaced one none.
            assert len(out.bindings) == (arg.replicas if out.placed else 0)
            if out.placed and arg.topology is not None and arg.topology.required:
                level = arg.topology.level
                groups = {int(s.node_level[level][s.node_index[b.node]]) for b in out.bindings}
                assert len(groups) == 1, "a required gang was split"
        elif op == "release" and s.allocs:
            aid = sorted(s.allocs)[arg % len(s.allocs)]
            s.release(aid)
        elif op == "what-if":
            before = s.state()
            mark = s.checkpoint()
            engine.place([arg])
            s.rollback(mark)
            after = s.state()
            for k in before["arrays"]:
                if k != "node_version":
                    assert np.array_equal(before["arrays"][k], after["arrays"][k]), k
            for k in ("allocs", "holders", "converted", "whole", "frac", "migx", "group_free"):
                assert before[k] == after[k], k
        check_invariants(s)
        s.commit()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(requests(), min_size=1, max_size=25), probe=requests())
def test_index_candidates_equal_the_vectorised_scan(ops, probe):
    """The free-capacity indexes hand out exactly what a full scan of the arrays finds."""
    s = fleet()
    engine = Engine(s, make_policy("best-fit"))
    engine.place(ops)
    if probe.shape.mig is not None:
        return
    tenant = s.tenant_id(probe.tenant)
    indexed = Engine(s, make_policy("best-fit"), candidate_limit=10**9).candidates(probe, tenant)
    scanned = engine.scan(probe, tenant)
    if probe.shape.gpus:
        assert set(indexed.node.tolist()) == set(scanned.node.tolist())
    else:
        # The scan lists every whole-free GPU of a node; the index one per node (equivalent).
        shared_i = _of_kind(indexed, 1)
        shared_s = _of_kind(scanned, 1)
        assert shared_i == shared_s
        assert {n for n, k in zip(indexed.node, indexed.kind, strict=False) if k == 2} == {
            n for n, k in zip(scanned.node, scanned.kind, strict=False) if k == 2
        }


def _of_kind(c, kind: int) -> set[tuple[int, int]]:
    return {(int(n), int(g)) for n, g, k in zip(c.node, c.slot, c.kind, strict=True) if k == kind}


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(requests(), min_size=1, max_size=25), probe=requests())
def test_fill_model_small_and_vector_paths_agree(ops, probe):
    """The plain-Python path (small candidate sets) and the numpy path give the same deltas."""
    from app.placement.engine import Candidates
    from app.placement.policies.fgd import DEFAULT_TYPICAL, FillModel, FragModel

    s = fleet()
    Engine(s, make_policy("best-fit")).place(ops)
    if probe.shape.mig is not None:
        return
    cands = Engine(s, make_policy("best-fit")).scan(probe, s.tenant_id(probe.tenant))
    if not len(cands):
        return
    small, vector = FillModel(DEFAULT_TYPICAL), FillModel(DEFAULT_TYPICAL)
    small.small_delta, small.small_refresh = 10**9, 10**9
    vector.small_delta, vector.small_refresh = 0, 0
    assert np.allclose(small.delta(s, probe, cands), vector.delta(s, probe, cands), atol=1e-6)
    # FGD's model: the small path against a fresh model forced onto the vector path.
    frag_small, frag_vec = FragModel(DEFAULT_TYPICAL), FragModel(DEFAULT_TYPICAL)
    big = Candidates(
        np.concatenate([cands.node] * 70),
        np.concatenate([cands.slot] * 70),
        np.concatenate([cands.kind] * 70),
    )
    d_small = frag_small.delta(s, probe, cands)
    d_vec = frag_vec.delta(s, probe, big)[: len(cands)]
    assert np.allclose(d_small, d_vec, atol=1e-6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    out=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=40),
    cordoned=st.lists(st.integers(0, 10**6), max_size=4),
    reqs=st.lists(requests(), min_size=1, max_size=30),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_nothing_ever_lands_on_a_gpu_out_of_the_pool(out, cordoned, reqs, policy):
    """GPUs the health loop took out (quarantined, draining, repairing, validating, out of
    service: FAILED to the core) and nodes it took out (unschedulable) never get work."""
    from app.placement.snapshot import FAILED

    s = fleet()
    bad: set[tuple[str, int]] = set()
    for n, slot in out:
        name = s.node_names[n % len(s.node_names)]
        if slot < int(s.node_ngpu[s.node_index[name]]):
            s.set_gpu_health(name, slot, FAILED)
            bad.add((name, slot))
    off = {s.node_names[n % len(s.node_names)] for n in cordoned}
    for name in off:
        s.set_schedulable(name, False)
    s.commit()
    plan = Engine(s, make_policy(policy, seed=3)).place(reqs)
    for o in plan.outcomes:
        for b in o.bindings:
            assert b.node not in off
            assert not {(b.node, g) for g in b.gpu_indices} & bad, (b, bad)


def test_an_nvl72_rack_with_failed_trays_offers_its_healthy_part():
    """A gang that needs all 72 GPUs in one NVLink domain needs 72 healthy ones; one of 64
    takes a rack with 16 healthy trays."""
    from app.placement.snapshot import FAILED

    s = Snapshot(nvl72("nvl", block="b1"))
    for tray in ("nvl-t16", "nvl-t17"):  # two compute trays out: 64 healthy GPUs left
        for g in range(4):
            s.set_gpu_health(tray, g, FAILED)
    s.commit()
    engine = Engine(s, make_policy("fgd", seed=1))
    need = Topology(Level.NVLINK_DOMAIN, True)
    whole = Request("w72", "ta", Tier.DEDICATED, Shape(gpus=4), 18, need)
    part = Request("w64", "ta", Tier.DEDICATED, Shape(gpus=4), 16, need)
    plan = engine.place([whole, part])
    assert not plan.outcomes[0].placed
    assert plan.outcomes[1].placed
    used = {b.node for b in plan.outcomes[1].bindings}
    assert not used & {"nvl-t16", "nvl-t17"}
