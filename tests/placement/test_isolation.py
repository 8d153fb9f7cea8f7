"""Every pair of tiers, on one GPU: the engine allows exactly what the isolation table allows."""

from __future__ import annotations

import itertools

import pytest

from app.placement.engine import Engine
from app.placement.isolation import GPU_SHARE, TIERS, Share, Tier, Unit
from app.placement.model import Request, Shape
from app.placement.policies import make_policy
from tests.fixtures.snapshots import hgx, node, snap

pytestmark = pytest.mark.no_db


def _request(rid: str, tier: Tier, tenant: str) -> Request:
    unit = TIERS[tier].unit
    if unit is Unit.FRACTION:
        shape = Shape(milli=300, gpu_mem_mib=1024)
    elif unit is Unit.MIG:
        shape = Shape(mig="1g")
    else:
        shape = Shape(gpus=1)
    return Request(rid, tenant, tier, shape)


@pytest.mark.parametrize("first, second", list(itertools.product(Tier, Tier)))
@pytest.mark.parametrize("same_tenant", [True, False])
def test_gpu_sharing_follows_the_table(first, second, same_tenant):
    # One node with a single GPU: a second request can only land by sharing it.
    s = snap(node("n1", gpus=1, model="H100-80GB"))
    engine = Engine(s, make_policy("first-fit"))
    plan = engine.place([_request("a", first, "ta")])
    assert plan.outcomes[0].placed
    out = engine.place([_request("b", second, "ta" if same_tenant else "tb")], plan).outcomes[-1]
    rule = GPU_SHARE[(first, second)]
    expected = rule is Share.ANY_TENANT or (rule is Share.SAME_TENANT and same_tenant)
    # Different units never share a GPU (a MIG GPU is not a time-sliced one).
    if TIERS[first].unit is not TIERS[second].unit:
        expected = False
    assert out.placed is expected, (first, second, same_tenant, out.reason)


def test_whole_gpu_tiers_never_share_even_on_big_nodes():
    s = snap(node("n1", gpus=2))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place(
        [_request(f"r{i}", t, f"t{i}") for i, t in enumerate((Tier.DEDICATED, Tier.VM))]
    )
    slots = [b.gpu_indices for b in plan.bindings]
    assert sorted(slots) == [(0,), (1,)]
    assert not engine.place([_request("x", Tier.MPS, "t9")], plan).outcomes[-1].placed


def test_multi_gpu_confidential_vm_takes_the_whole_hopper_node():
    s = snap(hgx("h", 2, model="H100-80GB"))
    engine = Engine(s, make_policy("best-fit"))
    cvm = Request("cvm", "ta", Tier.CONFIDENTIAL_VM, Shape(gpus=2))
    plan = engine.place([cvm])
    node_of_cvm = plan.bindings[0].node
    # Nothing else may land on that node, not even the same tenant's work.
    for _i, req in enumerate(
        [Request(f"d{i}", "ta", Tier.DEDICATED, Shape(gpus=1)) for i in range(6)]
    ):
        out = engine.place([req], plan).outcomes[-1]
        assert out.placed and out.bindings[0].node != node_of_cvm
    # A second multi-GPU CVM needs an empty node: the other node now has work on it.
    assert (
        not engine.place([Request("cvm2", "tb", Tier.CONFIDENTIAL_VM, Shape(gpus=2))], plan)
        .outcomes[-1]
        .placed
    )


def test_single_gpu_confidential_vm_is_per_gpu_and_blackwell_is_per_gpu():
    s = snap(hgx("b", 1, model="B200"))
    engine = Engine(s, make_policy("best-fit"))
    plan = engine.place(
        [
            Request("cvm", "ta", Tier.CONFIDENTIAL_VM, Shape(gpus=4)),
            Request("d", "tb", Tier.DEDICATED, Shape(gpus=4)),
        ]
    )
    assert all(o.placed for o in plan.outcomes)


@pytest.mark.parametrize(
    "tier, shape, why",
    [
        (Tier.CONFIDENTIAL_VM, Shape(mig="1g"), "hands out whole"),
        (Tier.MPS, Shape(gpus=1), "hands out fraction"),
        (Tier.VM, Shape(gpus=3), "1, 2, 4 or 8"),
        (Tier.TIMESLICE, Shape(milli=1000), "1..999"),
        (Tier.DEDICATED, Shape(gpus=1, milli=10), "one of"),
    ],
)
def test_impossible_combinations_are_refused_with_the_rule(tier, shape, why):
    s = snap(node("n1"))
    out = Engine(s, make_policy("best-fit")).place([Request("x", "t", tier, shape)]).outcomes[0]
    assert not out.placed and why in out.reason


def _cvm(rid: str, tenant: str, gpus: int = 1) -> Request:
    return Request(rid, tenant, Tier.CONFIDENTIAL_VM, Shape(gpus=gpus))


def _container(rid: str, tenant: str, gpus: int = 1) -> Request:
    return Request(rid, tenant, Tier.DEDICATED, Shape(gpus=gpus))


@pytest.mark.parametrize("policy", ["first-fit", "rackplane"])
def test_a_hopper_node_in_cc_mode_takes_only_confidential_vms(policy):
    """Hopper HGX sets CC mode node-wide: once a confidential VM is on a node, other tenants'
    confidential VMs may join it, containers may not; a node running a container takes no
    confidential VM."""
    s = snap(hgx("h", 2))
    engine = Engine(s, make_policy(policy))
    plan = engine.place([_cvm("cc1", "ta")])
    cc_node = plan.outcomes[0].bindings[0].node
    plan = engine.place([_cvm("cc2", "tb")], plan)
    assert plan.outcomes[-1].bindings[0].node == cc_node  # CC-mode node: shared by CVMs
    plan = engine.place([_container("c", "tc", 2)], plan)
    other = plan.outcomes[-1].bindings[0].node
    assert other != cc_node  # never beside the confidential VMs
    plan = engine.place([_container("fill", "tc", 6)], plan)
    assert plan.outcomes[-1].bindings[0].node == other
    # The CC node has 6 GPUs free, but takes no container; the other node is full.
    plan = engine.place([_container("late", "td", 1)], plan)
    assert not plan.outcomes[-1].placed
    # And a node with a container takes no confidential VM (the CC node still does).
    plan = engine.place([_cvm("cc3", "te")], plan)
    assert plan.outcomes[-1].bindings[0].node == cc_node


def test_a_blackwell_confidential_vm_takes_just_its_gpus():
    s = snap(node("b1", gpus=8, model="B200"))
    engine = Engine(s, make_policy("first-fit"))
    plan = engine.place([_cvm("cc", "ta", 2), _container("c", "tb", 4)])
    assert all(o.placed for o in plan.outcomes)
    assert {o.bindings[0].node for o in plan.outcomes} == {"b1"}
