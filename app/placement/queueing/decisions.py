"""Workloads as the scheduler sees them, and what a cycle decides about them: admissions,
evictions, reservations, and the answer to a what-if."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.placement.model import Binding, Reconfiguration, Request


@dataclass
class Workload:
    """A queued or running workload as the scheduler sees it.

    Running workloads carry the snapshot allocations they hold (`alloc_ids`), when the current
    run started, their last checkpoint and their last eviction."""

    id: str
    request: Request
    priority: str
    submitted_at: float
    max_runtime: float  # declared; the workload is stopped when it runs longer
    checkpoint_cost: float = 0.0  # seconds to write a checkpoint
    started_at: float | None = None
    last_checkpoint_at: float | None = None
    preempted_at: float | None = None
    alloc_ids: tuple[int, ...] = ()
    # Periodic checkpoints (seconds of run time); the last one counts if later than reported.
    checkpoint_every: float | None = None
    # Requeued after a hardware fault that was not its own: ahead of its priority peers.
    expedited: bool = False
    _charge: tuple[tuple[int, ...], list[tuple[str, int]], list[tuple[str, int]]] | None = field(
        default=None, repr=False, compare=False
    )
    _fit_key: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def gpu_milli(self) -> int:
        return self.request.shape.gpu_milli * self.request.replicas

    def last_checkpoint(self, now: float) -> float:
        assert self.started_at is not None, "only running workloads have checkpoints"
        last = self.started_at
        if self.last_checkpoint_at is not None:
            last = max(last, self.last_checkpoint_at)
        if self.checkpoint_every:
            k = (now - self.started_at) // self.checkpoint_every
            last = max(last, self.started_at + k * self.checkpoint_every)
        return last

    def lost_gpu_seconds(self, now: float) -> float:
        """Work lost if stopped now without a new checkpoint: GPUs x time since the last one."""
        return max(0.0, now - self.last_checkpoint(now)) * self.gpu_milli / 1000


@dataclass(frozen=True)
class Admission:
    workload: str
    bindings: tuple[Binding, ...]
    start_at: float  # after the victims' grace period when it preempted
    borrowed: bool  # beyond its tenant's guarantee: may be reclaimed
    phase: str
    victims: tuple[str, ...] = ()


@dataclass(frozen=True)
class Eviction:
    workload: str
    reason: str  # reclaim | fair-share | priority
    by: str  # the workload it makes room for
    deadline: float  # stops then (checkpoints during the grace period)
    lost_gpu_seconds: float  # if it cannot checkpoint within the grace period


@dataclass(frozen=True)
class Reservation:
    workload: str
    start_at: float
    gpus: tuple[tuple[str, int], ...]


@dataclass
class CycleResult:
    now: float
    admissions: list[Admission] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)  # workload -> why it waits
    # GPUs the admissions need in (or out of) MIG mode; they are idle.
    reconfigurations: list[Reconfiguration] = field(default_factory=list)


@dataclass(frozen=True)
class WhatIf:
    """Where a prospective workload would land now, whom it would preempt, or when it starts."""

    placeable_now: bool
    bindings: tuple[Binding, ...]
    preempts: tuple[str, ...]
    expected_start: float | None  # None: cannot start under its quota and the fleet
    reason: str
