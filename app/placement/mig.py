"""MIG geometry: profiles by (compute slices, memory slices), valid start slots, layouts.

Every MIG-capable GPU here has 7 compute slices and 8 memory slices (shared/reference/gpu.md).
A layout is a bitmask of used memory slices plus the compute slices in use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

MEMORY_SLICES = 8
COMPUTE_SLICES = 7
MAX_INSTANCES = 7


@dataclass(frozen=True)
class MigProfile:
    key: str  # "1g", "1g.2m", "2g", "3g", "4g", "7g"
    compute: int
    memory: int
    starts: tuple[int, ...]

    def mask(self, start: int) -> int:
        return ((1 << self.memory) - 1) << start

    @property
    def gpu_equivalent_milli(self) -> int:
        """Share of the GPU, for quotas and fractional accounting: memory slices / 8."""
        return self.memory * 1000 // MEMORY_SLICES


PROFILES: dict[str, MigProfile] = {
    p.key: p
    for p in (
        MigProfile("1g", 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile("1g.2m", 1, 2, (0, 2, 4, 6)),
        MigProfile("2g", 2, 2, (0, 2, 4)),
        MigProfile("3g", 3, 4, (0, 4)),
        MigProfile("4g", 4, 4, (0,)),
        MigProfile("7g", 7, 8, (0,)),
    )
}
BY_SHAPE = {(p.compute, p.memory): p for p in PROFILES.values()}
# Bigger profiles are worth more to keep placeable.
_KEEP_WEIGHT = {"7g": 64, "4g": 16, "3g": 12, "2g": 4, "1g.2m": 2, "1g": 1}

# Per-model profile names (shared/reference/gpu.md).
_NAMES = {
    "A100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-141GB": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    "B200": ("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    "GB200": ("1g.23gb", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"),
    "H100-PCIe-80GB": ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-NVL-141GB": ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}
_ORDER = ("1g", "1g.2m", "2g", "3g", "4g", "7g")


def model_profile_names(model: str) -> tuple[str, ...]:
    """The names NVIDIA gives `model`'s profiles (none for a model without MIG)."""
    return _NAMES.get(model, ())


def profile_names() -> dict[str, frozenset[str]]:
    """Every model-specific profile name, with the models that have it."""
    out: dict[str, set[str]] = {}
    for model, names in _NAMES.items():
        for name in names:
            out.setdefault(name, set()).add(model)
    return {name: frozenset(models) for name, models in out.items()}


def profile_name(model: str, profile: str) -> str:
    """The name NVIDIA uses for `profile` on `model`, e.g. ("H200-141GB", "3g") -> "3g.71gb"
    (a name already is one)."""
    if profile not in PROFILES:
        profile_by_name(model, profile)  # KeyError unless it is one of the model's names
        return profile
    return _NAMES[model][_ORDER.index(profile)]


def profile_by_name(model: str, name: str) -> MigProfile:
    """Inverse of profile_name; also accepts the generic keys ("3g")."""
    if name in PROFILES:
        return PROFILES[name]
    names = _NAMES.get(model)
    if names is None or name not in names:
        raise KeyError(f"{name!r} is not a MIG profile of {model}")
    return PROFILES[_ORDER[names.index(name)]]


def free_starts(
    profile: MigProfile, used_mask: int, compute_used: int, instances: int
) -> list[int]:
    """Valid, non-overlapping start slots for `profile` on a GPU with this layout."""
    if compute_used + profile.compute > COMPUTE_SLICES or instances >= MAX_INSTANCES:
        return []
    return [s for s in profile.starts if not (profile.mask(s) & used_mask)]


def fits(profile: MigProfile, used_mask: int, compute_used: int, instances: int) -> bool:
    return bool(free_starts(profile, used_mask, compute_used, instances))


@lru_cache(maxsize=4096)
def fitting_profiles(used_mask: int, compute_used: int, instances: int) -> tuple[str, ...]:
    """Keys of the profiles that still fit a GPU with this layout (memoised: layouts are few)."""
    return tuple(k for k, p in PROFILES.items() if fits(p, used_mask, compute_used, instances))


@lru_cache(maxsize=4096)
def keep_score(used_mask: int, compute_used: int, instances: int) -> int:
    """How valuable the remaining free space is: which profiles can still be placed."""
    return sum(
        w
        for key, w in _KEEP_WEIGHT.items()
        if fits(PROFILES[key], used_mask, compute_used, instances)
    )


def best_start(
    profile: MigProfile, used_mask: int, compute_used: int, instances: int
) -> int | None:
    """The start slot that keeps the most valuable profiles placeable (ties: the highest slot,
    so a 1g slice on an empty GPU lands at slot 6, not 0)."""
    best: tuple[int, int] | None = None
    for s in free_starts(profile, used_mask, compute_used, instances):
        score = keep_score(
            used_mask | profile.mask(s), compute_used + profile.compute, instances + 1
        )
        if best is None or (score, s) > best:
            best = (score, s)
    return None if best is None else best[1]


def valid_layout(placements: list[tuple[str, int]]) -> bool:
    """Whether (profile key, start) placements form a valid layout on one GPU."""
    used = compute = 0
    for key, start in placements:
        p = PROFILES[key]
        if start not in p.starts or p.mask(start) & used:
            return False
        used |= p.mask(start)
        compute += p.compute
    return compute <= COMPUTE_SLICES and len(placements) <= MAX_INSTANCES


def laid_free(layout: tuple[tuple[str, int], ...], used_mask: int) -> tuple[str, ...]:
    """The profiles of a laid-out GPU's instances that nothing holds (each once, in order)."""
    out: list[str] = []
    for key, start in layout:
        if key not in out and not PROFILES[key].mask(start) & used_mask:
            out.append(key)
    return tuple(out)


def laid_start(
    layout: tuple[tuple[str, int], ...], profile: MigProfile, used_mask: int
) -> int | None:
    """Where on a laid-out GPU a `profile` instance is free: the highest such start (as
    `best_start` breaks ties), or None."""
    starts = [
        start for key, start in layout if key == profile.key and not profile.mask(start) & used_mask
    ]
    return max(starts) if starts else None


# A layout: (profile key, start) per instance, sorted (a canonical form).
Layout = tuple[tuple[str, int], ...]


@lru_cache(maxsize=8)
def maximal_layouts(
    model: str | None = None, keys: tuple[str, ...] | None = None
) -> tuple[Layout, ...]:
    """Every valid layout to which no further instance fits, built from `keys` (default: every
    profile but 7g, which is the GPU whole). The same on every MIG model here (7 compute, 8
    memory slices; `model` is for when that stops being true). Sorted, canonical."""
    del model
    keys = keys or tuple(k for k in _ORDER if k != "7g")
    slots = [(k, s) for k in keys for s in PROFILES[k].starts]
    out: set[Layout] = set()

    def grow(i: int, chosen: list[tuple[str, int]], used: int, compute: int) -> None:
        for j in range(i, len(slots)):
            k, s = slots[j]
            p = PROFILES[k]
            if p.mask(s) & used or compute + p.compute > COMPUTE_SLICES:
                continue
            if len(chosen) >= MAX_INSTANCES:
                break
            chosen.append((k, s))
            grow(j + 1, chosen, used | p.mask(s), compute + p.compute)
            chosen.pop()
        # Maximal: nothing of `keys` fits any more.
        if chosen and not any(fits(PROFILES[k], used, compute, len(chosen)) for k in keys):
            out.add(tuple(sorted(chosen, key=lambda x: (x[1], x[0]))))

    grow(0, [], 0, 0)
    return tuple(sorted(out))
