"""The performance score: from telemetry and step times, and its decay toward nominal."""

from __future__ import annotations

import math

import pytest

from app.placement import perf

pytestmark = pytest.mark.no_db


def test_not_enough_reports_under_load_is_no_evidence():
    assert perf.from_telemetry(0.8, 0.0, perf.MIN_SAMPLES - 1, True) is None
    assert perf.from_telemetry(None, None, 100, True) is None


def test_the_clock_ratio_is_the_score_where_the_nominal_is_known():
    assert perf.from_telemetry(0.8, 1.0, 50, True) == 0.8
    assert perf.from_telemetry(1.07, 0.0, 50, True) == 1.0  # boost above nominal: not faster


def test_throttling_counts_where_the_clock_cannot_be_judged():
    assert perf.from_telemetry(None, 1.0, 50, False) == pytest.approx(1 - perf.THROTTLE_COST)
    assert perf.from_telemetry(0.5, 0.5, 50, False) == pytest.approx(1 - perf.THROTTLE_COST / 2)


def test_step_times_point_at_the_slow_rank():
    scores = perf.from_step_times({0: 1.0, 1: 1.0, 2: 1.25, 3: 1.0})
    assert scores[2] == pytest.approx(0.8) and scores[0] == scores[1] == scores[3] == 1.0
    assert perf.from_step_times({0: 1.0}) == {}  # one rank: nothing to compare with


@pytest.mark.parametrize("age", [0, 600, 3600, 21600, 86400])
def test_the_score_decays_toward_nominal(age):
    got = perf.decayed(0.8, age, 21600)
    assert got == pytest.approx(1 - 0.2 * math.exp(-age / 21600))
    assert 0.8 <= got <= 1.0


def test_only_moves_worth_a_fleet_reread_are_written():
    assert not perf.worth_writing(1.0, 0.99)
    assert perf.worth_writing(1.0, 0.97)
