"""The lifecycle table: every pair of states is either an allowed transition or an error."""

from __future__ import annotations

import itertools

import pytest

from app.scheduling.lifecycle import TERMINAL, TRANSITIONS, InvalidTransition, State, check

HAPPY = [
    "pending",
    "queued",
    "placing",
    "provisioning",
    "running",
    "checkpointing",
    "preempted",
    "queued",
    "placing",
    "provisioning",
    "running",
    "succeeded",
]


def test_the_documented_path_is_allowed_step_by_step():
    for a, b in itertools.pairwise(HAPPY):
        check(a, b)


@pytest.mark.parametrize("a, b", list(itertools.product(State, State)))
def test_every_pair_is_allowed_or_refused(a, b):
    if b in TRANSITIONS[a]:
        check(a, b)
    else:
        with pytest.raises(InvalidTransition):
            check(a, b)


def test_terminal_states_have_no_way_out_and_every_state_can_end():
    for s in TERMINAL:
        assert not TRANSITIONS[s]
    for s in State:
        if s not in TERMINAL:
            assert State.terminated in TRANSITIONS[s]
    assert State.running not in TRANSITIONS[State.queued]  # no skipping placement
    # An eviction goes via a checkpoint and a stop; running -> queued is only its own failure
    # restarting it (its restart policy), with nothing left to checkpoint.
    assert State.queued not in TRANSITIONS[State.checkpointing]
    assert State.queued in TRANSITIONS[State.running]
