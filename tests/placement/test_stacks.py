"""Software stacks in the placement core: a gang never spans two stacks nor lands on a drifted
node; a request may ask for a stack or a minimum CUDA version."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.placement.engine import NO_SOFTWARE, Engine
from app.placement.model import Level
from app.placement.policies import POLICIES, make_policy
from tests.fixtures.snapshots import node, preferred, required, snap, whole

pytestmark = pytest.mark.no_db

ALL = sorted(POLICIES)


def spec(name, stack=None, *, rack="r", cuda=0, drifted=False, open_=True):
    return replace(
        node(name, 8, rack=rack, schedulable=open_), stack=stack, cuda=cuda, drifted=drifted
    )


def stacks_of(s, outcome) -> set[str]:
    return {s.stack_names[int(s.node_stack[s.node_index[b.node]])] for b in outcome.bindings}


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("topology", [None, required(Level.RACK), preferred(Level.RACK)])
def test_a_gang_never_spans_two_stacks(policy, topology):
    def fleet(a, b):
        # One open node per stack: 16 GPUs free, but no stack has two open nodes.
        return snap(
            spec("a0", a), spec("a1", a, open_=False), spec("b0", b), spec("b1", b, open_=False)
        )

    gang = whole("g", 8, replicas=2, topology=topology)
    same = Engine(fleet("s1", "s1"), make_policy(policy, seed=1)).place([gang]).outcomes[0]
    assert same.placed, "one stack everywhere: the gang fits across a0 and b0"
    split = Engine(fleet("s1", "s2"), make_policy(policy, seed=1)).place([gang]).outcomes[0]
    assert not split.placed and not split.bindings, "it waits rather than span two stacks"

    # With room in one stack it goes there, whole.
    s = snap(spec("a0", "s1"), spec("a1", "s1"), spec("b0", "s2"), spec("b1", "s2", open_=False))
    out = Engine(s, make_policy(policy, seed=1)).place([gang]).outcomes[0]
    assert out.placed and {b.node for b in out.bindings} == {"a0", "a1"}
    assert stacks_of(s, out) == {"s1"}


@pytest.mark.parametrize("policy", ALL)
def test_a_drifted_node_takes_single_replicas_but_no_gang(policy):
    s = snap(spec("a0", "s1"), spec("a1", "s1", drifted=True), spec("a2", "s1"))
    eng = Engine(s, make_policy(policy, seed=1))
    plan = eng.place([whole("g", 8, replicas=2), whole("g2", 8, replicas=2)])
    g, g2 = plan.outcomes
    assert g.placed and "a1" not in {b.node for b in g.bindings}
    assert not g2.placed, "only the drifted node is left: no gang there"
    one = eng.place([whole("solo", 8)], plan).outcomes[-1]
    assert one.placed and one.bindings[0].node == "a1", "single-node work still runs there"


@pytest.mark.parametrize("policy", ALL)
def test_a_request_may_ask_for_a_stack_or_a_minimum_cuda(policy):
    s = snap(spec("old", "2025.10", cuda=12040), spec("new", "2026.10", cuda=12080), spec("bare"))
    eng = Engine(s, make_policy(policy, seed=1))
    asks = [
        replace(whole("pinned", 1), stack="2025.10"),
        replace(whole("cuda", 1), min_cuda=12060),
        replace(whole("cuda-gang", 1, replicas=2), min_cuda=12040),
        replace(whole("nowhere", 1), stack="2099.01"),
        replace(whole("too-new", 1), min_cuda=13000),
    ]
    pinned, cuda, gang, nowhere, too_new = eng.place(asks).outcomes
    assert pinned.bindings[0].node == "old"
    assert cuda.bindings[0].node == "new"
    assert gang.placed and {b.node for b in gang.bindings} <= {"old", "new"}
    assert len(stacks_of(s, gang)) == 1
    assert not nowhere.placed and nowhere.reason == NO_SOFTWARE
    assert not too_new.placed and too_new.reason == NO_SOFTWARE


def test_without_stacks_nothing_changes():
    """A fleet that declares no stacks places exactly as before (one stack, "", everywhere)."""
    reqs = [whole(f"r{i}", 1 + i % 8, replicas=1 + i % 3) for i in range(40)]
    base = [node(f"n{i}", 8, rack=f"r{i // 4}") for i in range(16)]
    one = Engine(snap(base), make_policy("rackplane", seed=7)).place(reqs)
    declared = [replace(n, stack="s1", cuda=12040) for n in base]
    two = Engine(snap(declared), make_policy("rackplane", seed=7)).place(reqs)
    assert [b.__dict__ for b in one.bindings] == [b.__dict__ for b in two.bindings]


@pytest.mark.parametrize("policy", ALL)
def test_work_goes_only_where_its_runtime_is_offered(policy):
    """A node's agent says what it can run (and `process` only in pools the operator trusts
    with it): a `process` replica never lands on a node offering only containers, and a node
    no agent runs (None) takes any."""
    s = snap(
        replace(spec("containers"), runtimes=frozenset({"podman"})),
        replace(spec("trusted"), runtimes=frozenset({"process", "podman"})),
        spec("simulated"),
    )
    eng = Engine(s, make_policy(policy, seed=1))
    asks = [
        replace(whole("proc", 8), runtime="process"),
        replace(whole("proc-2", 8), runtime="process"),
        replace(whole("proc-3", 8), runtime="process"),
        replace(whole("ctr", 8), runtime="podman"),
    ]
    p1, p2, p3, ctr = eng.place(asks).outcomes
    assert {p1.bindings[0].node, p2.bindings[0].node} == {"trusted", "simulated"}
    assert not p3.placed and p3.reason == "no capacity"
    assert ctr.bindings[0].node == "containers"
    only_containers = snap(replace(spec("c"), runtimes=frozenset({"podman"})))
    refused = Engine(only_containers, make_policy(policy, seed=1)).place(
        [replace(whole("proc", 1), runtime="process")]
    )
    assert refused.outcomes[0].reason == NO_SOFTWARE
