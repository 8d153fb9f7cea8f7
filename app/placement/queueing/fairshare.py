"""Fair-share arithmetic: usage history decayed over a half-life (kept between cycles), and the
weighted max-min split of capacity among tenants."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class UsageHistory:
    """Decayed usage per (tenant, model) in GPU-milli-seconds, with a configurable half-life."""

    half_life: float
    at: float | None = None
    decayed: dict[tuple[str, str], float] = field(default_factory=dict)

    def advance(self, now: float, usage: Mapping[tuple[str, str], int]) -> None:
        """Integrate `usage` (held since the last call) up to `now`, decaying what was before."""
        if self.at is None or now <= self.at:
            self.at = now if self.at is None else self.at
            return
        lam = math.log(2) / self.half_life
        decay = math.exp(-lam * (now - self.at))
        gain = (1 - decay) / lam
        for key in set(self.decayed) | set(usage):
            value = self.decayed.get(key, 0.0) * decay + usage.get(key, 0) * gain
            if value < 1e-3:
                self.decayed.pop(key, None)
            else:
                self.decayed[key] = value
        self.at = now

    def average(self, key: tuple[str, str]) -> float:
        """The decayed usage as an average rate (GPU-milli): constant use u converges to u."""
        return self.decayed.get(key, 0.0) * math.log(2) / self.half_life


def water_fill(capacity: float, demand: Mapping[str, float], weight: Mapping[str, float]) -> dict:
    """Weighted max-min fair split of `capacity` over tenants, each capped at its demand."""
    out = {t: 0.0 for t in demand}
    active = {t for t in demand if demand[t] > 0}
    left = capacity
    while active and left > 1e-9:
        wsum = sum(weight[t] for t in active)
        step = {t: left * weight[t] / wsum for t in active}
        capped = {t for t in active if out[t] + step[t] >= demand[t]}
        if not capped:
            for t in active:
                out[t] += step[t]
            break
        for t in capped:
            left -= demand[t] - out[t]
            out[t] = demand[t]
        active -= capped
    return out
