"""The GPU/node health state machine: every transition in the table, every refusal."""

from __future__ import annotations

import itertools

import pytest

from app.health import states
from app.health.states import Actor, H, Health, InvalidHealthTransition

pytestmark = pytest.mark.no_db

PAIRS = list(itertools.product(Health, Health))


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_each_pair_for_each_actor(a, b):
    who = states.TRANSITIONS.get((a, b), frozenset())
    for actor in Actor:
        for node in (False, True):
            ok = actor in who and (node or H.unreachable not in (a, b))
            assert states.allowed(a, b, actor, node=node) is ok
            if ok:
                states.check(a, b, actor, node=node)
            else:
                with pytest.raises(InvalidHealthTransition) as e:
                    states.check(a, b, actor, node=node)
                assert e.value.status == 409 and e.value.code == "invalid_health_transition"


def test_the_repair_path_is_open_to_the_loop():
    path = [H.healthy, H.suspect, H.quarantined, H.draining, H.repairing, H.validating, H.healthy]
    for a, b in itertools.pairwise(path):
        assert states.allowed(a, b, Actor.system, node=False)


def test_only_operators_release_or_return_from_service():
    for a in (H.quarantined, H.draining, H.repairing):
        assert states.allowed(a, H.healthy, Actor.operator, node=False)
        assert not states.allowed(a, H.healthy, Actor.system, node=False)
    assert states.allowed(H.out_of_service, H.validating, Actor.operator, node=False)
    assert not states.allowed(H.out_of_service, H.validating, Actor.system, node=False)
    # Out of service never goes straight back to healthy, even by hand: it is validated first.
    assert not states.allowed(H.out_of_service, H.healthy, Actor.operator, node=False)


def test_unreachable_is_for_nodes_and_the_error_says_what_is_allowed():
    with pytest.raises(InvalidHealthTransition) as e:
        states.check(H.healthy, H.unreachable, Actor.system, node=False)
    assert "allowed:" in e.value.detail and "unreachable" not in e.value.detail.split(":")[-1]
    states.check(H.healthy, H.unreachable, Actor.system, node=True)
    with pytest.raises(InvalidHealthTransition) as e:
        states.check(H.validating, H.repairing, Actor.operator, node=False)
    assert "allowed: healthy, out_of_service, quarantined" in e.value.detail


def test_placeable_and_out_partition_what_placement_uses():
    assert states.PLACEABLE == {H.healthy, H.suspect}
    assert not states.PLACEABLE & states.OUT
    assert H.out_of_service not in states.PLACEABLE | states.OUT  # out for good, not counted
