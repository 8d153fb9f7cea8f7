"""Requests, topology constraints and plan entries of the placement core (plain data)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.placement.isolation import TIERS, Tier, Unit
from app.placement.mig import PROFILES


class Level(enum.IntEnum):
    """Topology levels a gang can be kept inside, narrowest first."""

    NVLINK_DOMAIN = 0
    RACK = 1
    BLOCK = 2


@dataclass(frozen=True)
class Topology:
    level: Level
    required: bool = True


@dataclass(frozen=True)
class Shape:
    """What one replica needs.

    - whole GPUs: `gpus` >= 1 on one node (tiers dedicated, vm, confidential-vm);
    - a MIG slice: `mig` profile key ("1g", "1g.2m", "2g", "3g", "4g", "7g");
    - a fractional share: `milli` (1..999) and `gpu_mem_mib` on one GPU (time-slicing, MPS).
    Each with host CPU (milli-cores) and memory (MiB).
    """

    gpus: int = 0
    mig: str | None = None
    milli: int = 0
    gpu_mem_mib: int = 0
    cpu_milli: int = 0
    mem_mib: int = 0
    models: frozenset[str] | None = None  # allowed GPU models; None = any

    @property
    def cpu_only(self) -> bool:
        return not (self.gpus or self.mig or self.milli)

    @property
    def unit(self) -> Unit:
        if self.mig is not None:
            return Unit.MIG
        if self.gpus >= 1:
            return Unit.WHOLE
        return Unit.FRACTION

    @property
    def gpu_milli(self) -> int:
        """GPU-equivalents in milli: whole GPU 1000, MIG slice memory/8, a share its milli."""
        if self.mig is not None:
            return PROFILES[self.mig].gpu_equivalent_milli
        return self.gpus * 1000 if self.gpus else self.milli


def cuda_code(version: str | None) -> int:
    """A CUDA version as CUDA encodes it and the core compares it ("12.4" -> 12040); 0 for none
    or anything that does not start with MAJOR.MINOR."""
    parts = (version or "").split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1][:2].isdigit()):
        return 0
    minor = "".join(c for c in parts[1][:2] if c.isdigit()) or "0"
    return int(parts[0]) * 1000 + int(minor) * 10


def cuda_text(code: int) -> str | None:
    """12040 -> "12.4"; None for 0."""
    return f"{code // 1000}.{code % 1000 // 10}" if code else None


class RequestError(ValueError):
    """A request that can never be placed as asked (not a capacity problem)."""


@dataclass(frozen=True)
class Request:
    id: str
    tenant: str
    tier: Tier
    shape: Shape
    replicas: int = 1
    topology: Topology | None = None
    # Keep all replicas on GPUs of one performance class.
    same_perf_class: bool = True
    # Shared GPUs (node name, GPU index) this request must not join: a noisy neighbour's.
    avoid: frozenset[tuple[str, int]] = frozenset()
    # Software it needs: nodes running this stack, or at least this CUDA version (12040: 12.4).
    stack: str | None = None
    min_cuda: int = 0
    # How its replicas run on a node (`process`, `podman`): only nodes offering it (None: any).
    runtime: str | None = None

    def validate(self) -> None:
        s, unit = self.shape, TIERS[self.tier].unit
        if self.replicas < 1:
            raise RequestError("replicas must be at least 1")
        if self.min_cuda < 0:
            raise RequestError("min_cuda cannot be negative")
        if s.mig is not None and s.mig not in PROFILES:
            raise RequestError(f"unknown MIG profile {s.mig!r}")
        if sum(bool(x) for x in (s.gpus, s.mig, s.milli)) > 1:
            raise RequestError("a shape asks for one of: gpus, a MIG profile, or milli")
        if s.cpu_milli < 0 or s.mem_mib < 0 or s.gpu_mem_mib < 0:
            raise RequestError("resources cannot be negative")
        if s.cpu_only:
            return
        if s.unit is not unit:
            raise RequestError(
                f"tier {self.tier.label} hands out {unit.value} units, not {s.unit.value}"
            )
        if s.unit is Unit.FRACTION and not 0 < s.milli < 1000:
            raise RequestError("a fractional share is 1..999 milli-GPU")
        if self.tier in (Tier.VM, Tier.CONFIDENTIAL_VM) and s.gpus not in (1, 2, 4, 8):
            raise RequestError("a VM takes 1, 2, 4 or 8 GPUs of one node")
        if s.cpu_milli < 0 or s.mem_mib < 0 or s.gpu_mem_mib < 0:
            raise RequestError("resources cannot be negative")


@dataclass(frozen=True)
class Binding:
    """One replica placed: node and GPU slots, plus the MIG slot or share it takes."""

    alloc_id: int
    request_id: str
    replica: int
    node: str
    gpu_indices: tuple[int, ...]
    mig_profile: str | None = None
    mig_start: int | None = None
    milli: int = 0


@dataclass(frozen=True)
class Reconfiguration:
    """A GPU changes MIG mode (needs the GPU idle; resets it)."""

    node: str
    gpu_index: int
    mig_mode: bool


@dataclass
class Outcome:
    request_id: str
    placed: bool
    bindings: list[Binding] = field(default_factory=list)
    reason: str | None = None
