"""Rate-limit classes and their spec (`read=200/s,write=100/s,...`): what settings validate and
`app/ratelimit` enforces."""

from __future__ import annotations

import re
from dataclasses import dataclass

CLASSES = ("read", "write", "expensive", "signup", "signin", "anonymous")
_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Limit:
    """`capacity` tokens, refilled at `rate` per second."""

    capacity: float
    rate: float

    def scaled(self, factor: float) -> Limit:
        return Limit(self.capacity * factor, self.rate * factor)


def parse(spec: str) -> dict[str, Limit]:
    """`read=200/s,write=100/s,expensive=5/s,signup=20/m` -> a Limit per class (a class left
    out is not limited; `off` limits nothing). A bucket holds one period's worth."""
    if spec.strip().lower() in ("", "off", "none"):
        return {}
    out = {}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+(?:\.\d+)?)\s*/\s*([smh])\s*", part)
        if not m or m.group(1) not in CLASSES:
            raise ValueError(
                f"bad rate limit {part!r}: expected CLASS=N/s|m|h with CLASS one of "
                + ", ".join(CLASSES)
            )
        n, period = float(m.group(2)), _PERIODS[m.group(3)]
        out[m.group(1)] = Limit(capacity=max(n, 1.0), rate=n / period)
    return out
