from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, Field

from app.core.schemas import OutModel, StrictModel
from app.health.schemas import HOST_PATTERN


class NamedTarget(StrictModel):
    """One GPU: its node and index."""

    node: str = Field(max_length=63, pattern=HOST_PATTERN)
    gpu: int = Field(ge=0, le=63)


class NodeTarget(StrictModel):
    """One node, by name."""

    node: str = Field(max_length=63, pattern=HOST_PATTERN)


class RackTarget(StrictModel):
    """Every node of a rack, by name (an NVL72 rack is one NVLink domain)."""

    rack: str = Field(max_length=63, pattern=HOST_PATTERN)


class RandomTarget(StrictModel):
    """N random GPUs holding running work (of a tier, in a region)."""

    random_gpus: int = Field(ge=1, le=10_000)
    holding_tier: (
        Literal[
            "timeslice", "mps", "mig-shared", "mig-dedicated", "dedicated", "vm", "confidential-vm"
        ]
        | None
    ) = Field(None, description="Only GPUs holding running work of this tier")
    region: str | None = Field(None, max_length=63, pattern=HOST_PATTERN)


class XidFault(StrictModel):
    """An Xid on a GPU, as dcgm-exporter reports it."""

    kind: Literal["xid"]
    code: int = Field(ge=1, le=999)
    target: NamedTarget | NodeTarget | RackTarget | RandomTarget


class EccFault(StrictModel):
    """Uncorrectable (double-bit) ECC errors on a GPU."""

    kind: Literal["ecc_dbe"]
    target: NamedTarget | NodeTarget | RackTarget | RandomTarget


class ThrottleFault(StrictModel):
    """Thermal throttling: the GPU reports its hardware thermal slowdown and a clock held at
    `speed` of its maximum under load, for the last few minutes (it becomes slow)."""

    kind: Literal["throttle"]
    speed: float = Field(0.8, ge=0.1, le=0.99, description="Clock under load / the maximum")
    target: NamedTarget | NodeTarget | RackTarget | RandomTarget


class NodeLossFault(StrictModel):
    """The node is lost: its agent's reports stop reaching the control plane (its heartbeat
    stops) until the experiment stops. A GPU target means its node; random GPUs, their nodes."""

    kind: Literal["node_loss"]
    target: NodeTarget | NamedTarget | RackTarget | RandomTarget


class NvlinkFault(StrictModel):
    """NVLink errors (Xid 74) on every GPU of the target's NVLink domain: the whole NVL72 rack
    for GB200, the node for HGX."""

    kind: Literal["nvlink"]
    target: NodeTarget | NamedTarget | RackTarget


class ProviderFault(StrictModel):
    """The provider fails on the target's nodes: what is provisioned there does not boot
    (`boot`), or GPU resets and node reboots there fail (`repair`), until the experiment stops."""

    kind: Literal["provider"]
    fails: Literal["boot", "repair"]
    target: NodeTarget | NamedTarget | RackTarget


class NoisyNeighbourFault(StrictModel):
    """The largest workload on a shared GPU (time-slicing, MPS) saturates it: the GPU reports
    itself fully busy, and the other workloads' step times grow `slowdown` times over their
    best, as their agents would report them. The isolation tiers keep the sharers within one
    tenant; the health loop tells the victims and moves those that checkpoint."""

    kind: Literal["noisy_neighbour"]
    slowdown: float = Field(2.0, ge=1.5, le=100.0, description="Victims' step time / their best")
    target: NamedTarget


FaultIn = (
    XidFault
    | EccFault
    | ThrottleFault
    | NodeLossFault
    | NvlinkFault
    | ProviderFault
    | NoisyNeighbourFault
)


class BlastRadius(StrictModel):
    max_gpus: int = Field(ge=1, le=100_000, description="The most GPUs the faults may take out")
    max_region_share: float = Field(
        gt=0, le=1, description="The most of a region's GPUs the faults may take out"
    )


class AbortIn(StrictModel):
    """Stop the experiment (undoing it) as soon as either holds."""

    max_failed_workloads: int | None = Field(
        None, ge=0, le=100_000, description="More workloads than this failed since it started"
    )
    min_idle_gpus: int | None = Field(
        None, ge=0, le=10_000_000, description="Fewer ready, healthy, idle GPUs than this"
    )


class Schedule(StrictModel):
    """When the faults are injected: at `at` (default now), then again every `every_s` seconds
    until `times` rounds ran. Each round picks its random targets afresh; the blast radius
    bounds all rounds together."""

    at: AwareDatetime | None = Field(None, description="First round (with an offset)")
    every_s: int = Field(3600, ge=30, le=7 * 86400, description="Between rounds")
    times: int = Field(1, ge=1, le=100, description="Rounds in all")


class ExperimentIn(StrictModel):
    name: str = Field(max_length=200)
    faults: list[FaultIn] = Field(min_length=1, max_length=100)
    blast_radius: BlastRadius
    abort: AbortIn | None = None
    schedule: Schedule | None = None


class InjectionOut(OutModel):
    id: uuid.UUID
    kind: str
    code: int | None
    detail: str | None = Field(description="provider: what fails (boot | repair)")
    node: str
    gpu_index: int | None
    injected_at: datetime
    undone_at: datetime | None


class FaultReport(BaseModel):
    injection: uuid.UUID
    node: str
    gpu_index: int | None
    incident: uuid.UUID | None
    action: str | None
    detect_s: float | None = Field(description="Injected to the incident opened")
    quarantine_s: float | None = Field(description="Injected to the hardware out of the pool")
    requeue_s: float | None = Field(description="Injected to the last affected workload queued")
    running_s: float | None = Field(
        description="Injected to the last affected workload running again"
    )
    workloads: list[uuid.UUID]
    lost_work_gpu_s: float


class Invariants(BaseModel):
    double_allocations: int = Field(description="GPUs held by two live whole allocations at once")
    usage_after_fault: int = Field(description="Usage of stopped work past its fault's instant")
    inconsistent_workloads: int = Field(
        description="Affected workloads holding allocations while not holding GPUs, or the reverse"
    )
    grace_cut_short: int = Field(
        description="Preempted workloads stopped before the end of their grace period"
    )
    breaker_exceeded: int = Field(
        description="Automatic take-outs past the circuit breaker's region or rack limit"
    )
    cross_tenant_sharing: int = Field(
        description="GPUs time-sliced or MPS-shared by workloads of more than one tenant"
    )


class ExperimentState(str, enum.Enum):
    scheduled = "scheduled"
    running = "running"
    stopped = "stopped"
    aborted = "aborted"


class ExperimentSummaryOut(OutModel):
    """An experiment without its report (`GET /v1/admin/chaos/experiments/{id}` has that)."""

    id: uuid.UUID
    name: str
    state: str = Field(description="scheduled | running | stopped | aborted")
    rounds: int = Field(description="Rounds of faults injected so far")
    next_at: datetime | None = Field(description="The next round, if one is scheduled")
    abort_reason: str | None
    gpus_touched: int
    started_at: datetime
    stopped_at: datetime | None


class ExperimentOut(OutModel):
    id: uuid.UUID
    name: str
    state: str = Field(description="scheduled | running | stopped | aborted")
    rounds: int = Field(description="Rounds of faults injected so far")
    next_at: datetime | None = Field(description="The next round, if one is scheduled")
    abort_reason: str | None
    gpus_touched: int
    started_at: datetime
    stopped_at: datetime | None
    injections: list[InjectionOut]
    report: list[FaultReport]
    invariants: Invariants
    held: bool = Field(description="Every invariant held")
