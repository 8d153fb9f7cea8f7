from __future__ import annotations

import pytest

from app.placement import mig
from app.placement.mig import PROFILES, best_start, free_starts, profile_name, valid_layout

pytestmark = pytest.mark.no_db


@pytest.mark.parametrize(
    "key, compute, memory, starts",
    [
        ("1g", 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        ("1g.2m", 1, 2, (0, 2, 4, 6)),
        ("2g", 2, 2, (0, 2, 4)),
        ("3g", 3, 4, (0, 4)),
        ("4g", 4, 4, (0,)),
        ("7g", 7, 8, (0,)),
    ],
)
def test_profiles_match_the_reference_geometry(key, compute, memory, starts):
    p = PROFILES[key]
    assert (p.compute, p.memory, p.starts) == (compute, memory, starts)
    assert all(p.mask(s) < 1 << mig.MEMORY_SLICES for s in starts)


@pytest.mark.parametrize(
    "model, key, name",
    [
        ("A100-80GB", "1g", "1g.10gb"),
        ("H100-80GB", "3g", "3g.40gb"),
        ("H200-141GB", "3g", "3g.71gb"),
        ("B200", "7g", "7g.180gb"),
        ("GB200", "1g.2m", "1g.47gb"),
        ("H200-141GB", "2g", "2g.35gb"),
    ],
)
def test_per_model_names(model, key, name):
    assert profile_name(model, key) == name
    assert mig.profile_by_name(model, name) is PROFILES[key]


@pytest.mark.parametrize(
    "placements, ok",
    [
        ([("4g", 0), ("3g", 4)], True),
        ([("3g", 0), ("3g", 4)], True),
        ([("7g", 0)], True),
        ([("7g", 0), ("1g", 6)], False),
        ([("1g", s) for s in range(7)], True),
        ([("1g", s) for s in range(7)] + [("1g", 6)], False),
        ([("2g", 0), ("2g", 2), ("2g", 4), ("1g", 6)], True),
        ([("2g", 6)], False),  # not a valid start
        ([("4g", 0), ("3g", 4), ("1g", 7)], False),
        ([("1g.2m", 6), ("4g", 0)], True),
    ],
)
def test_layout_validity(placements, ok):
    assert valid_layout(placements) is ok


def test_small_slices_keep_large_profiles_placeable():
    assert best_start(PROFILES["1g"], 0, 0, 0) == 6
    assert best_start(PROFILES["3g"], 0, 0, 0) == 4  # 4g at 0 still fits
    # With 3g at 4 taken, the next 1g goes to 3, keeping 2g at 0 placeable... or 2/1 lower.
    used = PROFILES["3g"].mask(4)
    start = best_start(PROFILES["1g"], used, 3, 1)
    assert start is not None and not (PROFILES["1g"].mask(start) & used)
    assert free_starts(PROFILES["2g"], used, 3, 1)  # a 2g still fits after that


def test_compute_and_instance_limits():
    full_compute = PROFILES["4g"].mask(0)
    assert free_starts(PROFILES["4g"], full_compute, 7, 1) == []
    assert free_starts(PROFILES["1g"], 0b0111_1111, 7, 7) == []
