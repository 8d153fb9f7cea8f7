from __future__ import annotations

import numpy as np
import pytest

from app.placement.engine import CPU_ONLY, Candidates, Engine
from app.placement.isolation import Tier
from app.placement.model import Level, Request, Shape
from app.placement.policies import POLICIES, make_policy, typical_shapes
from app.placement.policies.fgd import HostModel
from app.placement.snapshot import DEGRADED, FAILED
from tests.fixtures.snapshots import (
    assert_same_state,
    hgx,
    mig,
    node,
    nvl72,
    preferred,
    required,
    share,
    snap,
    whole,
)

pytestmark = pytest.mark.no_db

ALL = sorted(POLICIES)


@pytest.mark.parametrize("policy", ALL)
def test_whole_gpus_land_on_one_node_of_an_allowed_model(policy):
    s = snap(node("a", 8, "H100-80GB"), node("b", 8, "H200-141GB"), node("c", 2, "H100-80GB"))
    plan = Engine(s, make_policy(policy, seed=1)).place(
        [whole("r1", 4, models=["H200-141GB"]), whole("r2", 3), whole("r3", 9)]
    )
    r1, r2, r3 = plan.outcomes
    assert r1.placed and r1.bindings[0].node == "b" and len(r1.bindings[0].gpu_indices) == 4
    assert r2.placed and len(set(r2.bindings[0].gpu_indices)) == 3
    assert not r3.placed and not r3.bindings


def test_best_fit_packs_and_spread_spreads():
    nodes = [node("a", 8), node("b", 8)]
    for policy, same in (("best-fit", True), ("spread", False), ("rackplane", True)):
        s = snap(*nodes)
        plan = Engine(s, make_policy(policy, seed=3)).place([whole("x", 2), whole("y", 2)])
        assert (plan.bindings[0].node == plan.bindings[1].node) is same, policy


def test_cpu_and_memory_must_fit():
    s = snap(node("small", 8, cpu=4000), node("big", 8))
    plan = Engine(s, make_policy("first-fit")).place([whole("x", 1, cpu=8000)])
    assert plan.bindings[0].node == "big"


def test_cordoned_nodes_and_failed_gpus_are_never_used():
    s = snap(node("a", 2, schedulable=False), node("b", 2, health=(FAILED, 0)))
    engine = Engine(s, make_policy("first-fit"))
    plan = engine.place([whole("x", 1), whole("y", 1)])
    assert plan.outcomes[0].placed and plan.bindings[0].node == "b"
    assert plan.bindings[0].gpu_indices == (1,)
    assert not plan.outcomes[1].placed


def test_degraded_and_slow_gpus_are_avoided_while_others_fit():
    s = snap(node("slow", 8, perf=0.7), node("deg", 8, health=(DEGRADED,) * 8), node("ok", 8))
    plan = Engine(s, make_policy("first-fit")).place([whole("x", 8)])
    assert plan.bindings[0].node == "ok"
    plan = Engine(s, make_policy("first-fit")).place([whole("y", 8)], plan)
    assert plan.bindings[-1].node == "slow"  # slow beats degraded; still placed when needed


def test_mig_slice_prefers_an_existing_mig_gpu_then_converts_an_idle_one():
    s = snap(node("a", 8, mig=(7,)))
    engine = Engine(s, make_policy("rackplane"))
    plan = engine.place([mig("m1", "3g")])
    b = plan.bindings[0]
    assert (b.gpu_indices, b.mig_profile, b.mig_start) == ((7,), "3g", 4)
    assert plan.reconfigurations == []
    plan = engine.place([mig("m2", "4g"), mig("m3", "7g")], plan)
    m2, m3 = plan.outcomes[1:]
    assert m2.bindings[0].gpu_indices == (7,) and m2.bindings[0].mig_start == 0
    # 7g needs an empty MIG GPU: an idle whole GPU is turned into MIG mode, and the plan says so.
    assert m3.placed and m3.bindings[0].gpu_indices != (7,)
    assert [(r.node, r.gpu_index, r.mig_mode) for r in plan.reconfigurations] == [
        ("a", m3.bindings[0].gpu_indices[0], True)
    ]


def test_one_g_slice_on_an_empty_gpu_lands_at_slot_6():
    s = snap(node("a", 1, mig=(0,)))
    plan = Engine(s, make_policy("best-fit")).place([mig("m", "1g")])
    assert plan.bindings[0].mig_start == 6


def test_mig_fills_to_seven_slices_and_no_more():
    s = snap(node("a", 1, mig=(0,)))
    plan = Engine(s, make_policy("best-fit"), allow_mig_reconfigure=False).place(
        [mig(f"m{i}", "1g") for i in range(8)]
    )
    starts = sorted(b.mig_start for b in plan.bindings)
    assert starts == [0, 1, 2, 3, 4, 5, 6] and not plan.outcomes[-1].placed


def test_mig_profiles_only_on_mig_capable_models():
    s = snap(node("t4", 2, "T4"))
    assert not Engine(s, make_policy("best-fit")).place([mig("m", "1g")]).outcomes[0].placed


def test_fractional_shares_pack_one_gpu_per_tenant():
    s = snap(node("a", 2))
    engine = Engine(s, make_policy("rackplane"))
    plan = engine.place([share("s1", 400), share("s2", 500), share("s3", 300, tenant="t2")])
    g = [b.gpu_indices[0] for b in plan.bindings]
    assert g[0] == g[1] and g[2] != g[0]
    assert not engine.place([share("s4", 200)], plan).outcomes[-1].placed  # GPU0 has 100 left
    assert engine.place([share("s5", 100)], plan).outcomes[-1].placed


def test_vm_sizes():
    s = snap(node("a", 8))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place([Request("v", "t", Tier.VM, Shape(gpus=g)) for g in (1, 2, 4)])
    assert all(o.placed for o in plan.outcomes)
    assert (
        "1, 2, 4 or 8"
        in engine.place([Request("v3", "t", Tier.VM, Shape(gpus=3))], plan).outcomes[-1].reason
    )


# --- gangs ---------------------------------------------------------------------------------------


def test_gang_is_all_or_nothing_and_leaves_no_trace():
    s = snap(hgx("h", 2))
    engine = Engine(s, make_policy("best-fit"))
    before = s.state()
    plan = engine.place([whole("g", 4, replicas=5)])
    assert not plan.outcomes[0].placed and plan.bindings == []
    after = s.state()
    assert before["allocs"] == after["allocs"] and before["whole"] == after["whole"]
    assert engine.place([whole("g2", 4, replicas=4)], plan).outcomes[-1].placed


def test_required_nvlink_domain_gang_stays_in_one_nvl72_rack_with_contiguous_ranks():
    s = snap(nvl72("rackA"), nvl72("rackB"))
    engine = Engine(s, make_policy("rackplane"))
    # Use part of rack A so a 64-GPU gang no longer fits there.
    plan = engine.place([whole("filler", 4, replicas=3, topology=required(Level.NVLINK_DOMAIN))])
    plan = engine.place([whole("g", 4, replicas=16, topology=required(Level.NVLINK_DOMAIN))], plan)
    gang = plan.outcomes[-1]
    assert gang.placed
    racks = {b.node.split("-t")[0] for b in gang.bindings}
    assert len(racks) == 1
    trays = [int(b.node.split("-t")[1]) for b in sorted(gang.bindings, key=lambda b: b.replica)]
    assert trays == sorted(trays) and trays[-1] - trays[0] == 15  # contiguous ranks
    # A 73-GPU required gang can never fit one domain: refused, nothing placed.
    plan = engine.place(
        [whole("big", 1, replicas=73, topology=required(Level.NVLINK_DOMAIN))], plan
    )
    assert not plan.outcomes[-1].placed


def test_required_gang_is_never_split_even_when_capacity_exists_across_domains():
    s = snap(hgx("h", 2))  # two HGX nodes: two NVLink domains of 8
    out = (
        Engine(s, make_policy("best-fit"))
        .place([whole("g", 1, replicas=12, topology=required(Level.NVLINK_DOMAIN))])
        .outcomes[0]
    )
    assert not out.placed


def test_preferred_gang_spans_the_fewest_domains():
    s = snap(hgx("a", 1, rack="r1"), hgx("b", 1, rack="r1"), hgx("c", 1, rack="r2"))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place([whole("half", 4)])  # node a000 or so now has 4 free
    used = plan.bindings[0].node
    plan = engine.place([whole("g", 1, replicas=12, topology=preferred(Level.NVLINK_DOMAIN))], plan)
    g = plan.outcomes[-1]
    assert g.placed and len({b.node for b in g.bindings}) == 2
    assert used not in {b.node for b in g.bindings} or len({b.node for b in g.bindings}) == 2


def test_rack_and_block_levels():
    s = snap(
        hgx("a", 2, rack="r1", block="b1"),
        hgx("b", 2, rack="r2", block="b1"),
        hgx("c", 1, rack="r3", block="b2"),
    )
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place(
        [
            whole("rk", 8, replicas=2, topology=required(Level.RACK)),
            whole("bk", 8, replicas=2, topology=required(Level.BLOCK)),
            whole("no", 8, replicas=2, topology=required(Level.RACK)),
        ]
    )
    rk, bk, no = plan.outcomes
    assert rk.placed and len({b.node[0] for b in rk.bindings}) == 1
    assert bk.placed and {b.node[0] for b in bk.bindings} <= {"a", "b"}
    assert not no.placed  # only r3 (one node) is left


def test_gang_members_keep_one_performance_class():
    nodes = [node(f"fast{i}", 8, rack="r", perf=1.0) for i in range(2)] + [
        node(f"slow{i}", 8, rack="r", perf=0.6) for i in range(2)
    ]
    s = snap(*nodes)
    plan = Engine(s, make_policy("first-fit")).place([whole("g", 8, replicas=2)])
    assert {b.node[:4] for b in plan.bindings} == {"fast"}


def test_plan_checkpoint_rollback_and_commit():
    s = snap(hgx("h", 2))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place([whole("a", 2)])
    mark = plan.checkpoint()
    state = s.state()
    engine.place([whole("b", 8), mig("m", "2g")], plan)
    assert len(plan.bindings) == 3 and plan.reconfigurations
    plan.rollback(mark)
    assert len(plan.bindings) == 1 and not plan.reconfigurations
    assert_same_state(state, s.state())
    plan.commit()
    assert s.checkpoint() == 0


def test_confidential_vms_only_on_models_with_confidential_computing():
    s = snap(node("a100", 8, "A100-80GB"), node("t4", 2, "T4"))
    engine = Engine(s, make_policy("best-fit"))
    out = engine.place([Request("c", "t", Tier.CONFIDENTIAL_VM, Shape(gpus=1))]).outcomes[0]
    assert not out.placed
    s = snap(node("a100", 8, "A100-80GB"), node("h100", 8, "H100-80GB"))
    out = (
        Engine(s, make_policy("best-fit"))
        .place([Request("c", "t", Tier.CONFIDENTIAL_VM, Shape(gpus=1))])
        .outcomes[0]
    )
    assert out.placed and out.bindings[0].node == "h100"


def test_gpus_the_core_put_into_mig_mode_return_to_whole_when_idle():
    s = snap(node("a", 1))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place([mig("m", "1g")])
    assert plan.reconfigurations and plan.outcomes[0].placed
    assert not engine.place([whole("w", 1)], plan).outcomes[-1].placed
    assert s.release(plan.bindings[0].alloc_id) == [("a", 0)]
    assert engine.place([whole("w2", 1)], plan).outcomes[-1].placed
    # A GPU that the operator put in MIG mode stays in MIG mode.
    s = snap(node("b", 1, mig=(0,)))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place([mig("m", "1g")])
    assert s.release(plan.bindings[0].alloc_id) == []


def test_mig_gang_with_required_rack_topology():
    s = snap(
        hgx("a", 2, rack="r1", mig=tuple(range(8))), hgx("b", 1, rack="r2", mig=tuple(range(8)))
    )
    req = Request(
        "g", "t", Tier.MIG_SHARED, Shape(mig="3g"), replicas=20, topology=required(Level.RACK)
    )
    out = Engine(s, make_policy("best-fit")).place([req]).outcomes[0]
    assert out.placed and {b.node[0] for b in out.bindings} == {"a"}


def test_preferred_gang_fills_the_emptiest_group_first():
    s = snap(hgx("a", 1, rack="r1"), hgx("b", 2, rack="r2"))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place([whole("g", 8, replicas=3, topology=preferred(Level.RACK))])
    nodes = [b.node for b in sorted(plan.outcomes[0].bindings, key=lambda b: b.replica)]
    assert nodes[:2] == ["b000", "b001"] and nodes[2] == "a000"


def test_rackplane_keeps_host_cpu_in_step_with_free_gpus():
    # Typical work asks 12 cores per GPU, in 1- and 2-GPU pods (half each). A 20-core GPU pod:
    # - on "rich" (2 GPUs, 104 cores) it leaves 1 GPU, no room for a 2-GPU pod: FGD counts
    #   half of that GPU as fragmented (+500);
    # - on "lean" (4 GPUs, 48 cores) it leaves 3 GPUs and 28 cores: both shapes still fit, so
    #   FGD sees nothing (0) and always picks "lean"; but 28 cores feed only 2,333 milli of
    #   the 3,000 idle, and the host term counts the other 667. Rackplane picks "rich".
    typical = typical_shapes(
        [Shape(gpus=1, cpu_milli=12_000), Shape(gpus=2, cpu_milli=24_000)], coverage=1.0
    )
    picks: dict[str, set[str]] = {"fgd": set(), "rackplane": set()}
    for seed in range(8):
        for name in picks:
            s = snap(node("lean", 4, cpu=48_000), node("rich", 2, cpu=104_000))
            plan = Engine(s, make_policy(name, seed=seed, typical=typical)).place(
                [whole("x", 1, cpu=20_000)]
            )
            picks[name].add(plan.bindings[0].node)
    assert picks["rackplane"] == {"rich"}
    assert picks["fgd"] == {"lean"}


def test_host_model_counts_gpus_the_free_cpu_cannot_feed():
    host = HostModel(typical_shapes([Shape(gpus=1, cpu_milli=10_000)]))  # 0.1 milli-GPU per mcore
    # a: 4 idle GPUs, 40 cores: nothing stranded. b: 2 idle GPUs, 12 cores feed 1,200 milli.
    s = snap(node("a", 4, cpu=40_000), node("b", 2, cpu=12_000))
    cands = Candidates(np.array([0, 1]), np.array([-1, -1]), np.array([CPU_ONLY, CPU_ONLY]))
    cpu_only = Request("c", "t1", Tier.DEDICATED, Shape(cpu_milli=10_000, mem_mib=1))
    # 10 cores fewer: a feeds 3,000 of its 4,000 idle milli, b 200 of its 2,000.
    assert host.delta(s, cpu_only, cands).tolist() == [1000.0, 1000.0]
    light = Request("g", "t1", Tier.DEDICATED, Shape(gpus=1, cpu_milli=2_000, mem_mib=1))
    # A GPU pod with little CPU: a stays fed; b's last idle GPU is fed by its 10 cores left.
    assert host.delta(s, light, cands).tolist() == [0.0, -800.0]


def test_a_gang_lands_on_the_fewest_nodes_whatever_the_constraint_level():
    """The README's gang, 2 x 4 H100 with `rack` required: with the first node of the rack
    half taken and the second entirely free, both replicas go to the free node (one node),
    not one on each (the name order did that)."""
    s = snap(hgx("h", 2, rack="r1"))
    engine = Engine(s, make_policy("rackplane"))
    plan = engine.place([whole("half", 4)])
    taken = plan.bindings[0].node
    gang = engine.place([whole("g", 4, replicas=2, topology=required(Level.RACK))], plan)
    out = gang.outcomes[-1]
    assert out.placed
    assert {b.node for b in out.bindings} == {"h001" if taken == "h000" else "h000"}
    # Three replicas of 4 need two nodes: the free node whole, then the half-used one.
    s2 = snap(hgx("h", 2, rack="r1"))
    e2 = Engine(s2, make_policy("rackplane"))
    p2 = e2.place([whole("half", 4)])
    p2 = e2.place([whole("g3", 4, replicas=3, topology=required(Level.RACK))], p2)
    b3 = sorted(p2.outcomes[-1].bindings, key=lambda b: b.replica)
    assert len({b.node for b in b3}) == 2 and b3[0].node == b3[1].node  # ranks contiguous


def test_mig_on_a_laid_out_gpu_uses_only_its_instances_and_never_converts():
    """A node agent laid GPU 0 out as 3g@4, 2g@2, 1g@0, 1g@1: MIG work goes only on those
    instances (a 4g, which an empty MIG GPU could take, does not fit), and on such a node an
    idle whole GPU is never turned into MIG mode by placing work (only a relayout does)."""
    from dataclasses import replace

    laid = ((0, (("3g", 4), ("2g", 2), ("1g", 0), ("1g", 1))),)
    a = replace(node("a", 2, mig=(0,)), mig_layouts=laid, fixed_mig=True)
    engine = Engine(snap(a), make_policy("rackplane"))
    plan = engine.place([mig("m1", "1g"), mig("m2", "3g"), mig("m3", "1g"), mig("m4", "1g")])
    got = [
        (o.bindings[0].mig_profile, o.bindings[0].mig_start) if o.placed else None
        for o in plan.outcomes
    ]
    assert got == [("1g", 1), ("3g", 4), ("1g", 0), None], got  # two 1g instances, no third
    plan = engine.place([mig("m5", "4g"), mig("m6", "2g")], plan)
    assert not plan.outcomes[-2].placed, "no 4g instance is laid out, and GPU 1 stays whole"
    assert plan.outcomes[-1].bindings[0].mig_start == 2
    assert plan.reconfigurations == []
    # The same GPU with no layout (nothing lays it out): any valid start, and conversions.
    free = Engine(snap(node("b", 2, mig=(0,))), make_policy("rackplane"))
    assert free.place([mig("m7", "4g"), mig("m8", "7g")]).reconfigurations
