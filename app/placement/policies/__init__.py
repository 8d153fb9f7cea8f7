"""Named placement policies; a pool's configuration selects one by name."""

from __future__ import annotations

from app.placement.policies.base import Policy
from app.placement.policies.fgd import FGD, RackplanePolicy, TypicalShape, typical_shapes
from app.placement.policies.simple import BestFit, FirstFit, GpuPacking, Spread

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (FirstFit, BestFit, Spread, GpuPacking, FGD, RackplanePolicy)
}
DEFAULT_POLICY = RackplanePolicy.name


def make_policy(
    name: str, *, seed: int | None = None, typical: list[TypicalShape] | None = None, **kwargs
) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    if cls in (FGD, RackplanePolicy):
        return cls(seed=seed, typical=typical, **kwargs)
    return cls(seed=seed, **kwargs)


__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "make_policy", "typical_shapes"]
