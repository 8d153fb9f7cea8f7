"""A GPU's performance score: its speed relative to its model's nominal (1.0), from evidence.

Evidence, each an estimate of the same thing:
- the sustained SM clock under load against the model's maximum clock (where the catalog has
  it): a GPU held at 80 % of its clock runs compute-bound work at about 80 % speed;
- the share of reports under load with throttling reasons set (thermal, power, hardware
  slowdown), where the clock cannot be judged: a GPU throttled all the time is counted 20 %
  slow, the order of the thermal slowdowns fleets report;
- per-rank step times a workload reports: a rank slower than its gang's median points at its
  GPU (the gang runs at the pace of that rank).

The score is the lowest estimate, and without new evidence it fades back toward nominal
(`decayed`): a GPU fixed by a reseat or a firmware update is not shunned for ever."""

from __future__ import annotations

import math

# Reports under load before the clock and throttle aggregates are trusted.
MIN_SAMPLES = 10
# Utilisation (percent) from which a report counts as "under load".
LOAD_UTIL = 50.0
# Weight of each new report in the exponentially weighted aggregates (about 10 reports).
ALPHA = 0.1
THROTTLE_COST = 0.2
# A change smaller than this is not written (each write re-reads the region's fleet).
WRITE_STEP = 0.02


def ewma(old: float | None, new: float, alpha: float = ALPHA) -> float:
    return new if old is None else old + alpha * (new - old)


def from_telemetry(
    clock_ratio: float | None, throttled: float | None, samples: int, nominal_known: bool
) -> float | None:
    """The score the clock/throttle aggregates support, or None without enough evidence."""
    if samples < MIN_SAMPLES:
        return None
    if nominal_known and clock_ratio is not None:
        return round(min(1.0, max(0.1, clock_ratio)), 3)
    if throttled is not None:
        return round(1.0 - THROTTLE_COST * min(1.0, max(0.0, throttled)), 3)
    return None


def from_step_times(step_s: dict[int, float]) -> dict[int, float]:
    """Per rank, the speed its step time implies against the gang's median (1.0 at or below
    the median): {rank: step seconds} -> {rank: score}."""
    if len(step_s) < 2:
        return {}
    times = sorted(step_s.values())
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    if median <= 0:
        return {}
    return {r: round(min(1.0, median / t), 3) for r, t in step_s.items() if t > 0}


def decayed(score: float, age_s: float, tau_s: float) -> float:
    """`score` measured `age_s` ago, faded toward 1.0 with time constant `tau_s`."""
    score = min(score, 1.0)
    if age_s <= 0:
        return score
    return 1.0 - (1.0 - score) * math.exp(-age_s / tau_s)


def worth_writing(old: float, new: float) -> bool:
    return abs(new - old) >= WRITE_STEP
