from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel, Field

from app.core.schemas import OutModel, StrictModel
from app.health.states import Health
from app.models.fleet import ImportStatus, NodeState


class RegionOut(OutModel):
    id: uuid.UUID
    name: str
    created_at: datetime


class RackOut(OutModel):
    id: uuid.UUID
    region_id: uuid.UUID
    name: str
    kind: str
    block: str
    created_at: datetime


class GpuOut(OutModel):
    id: uuid.UUID
    node_id: uuid.UUID
    index: int
    model: str
    mig_mode: bool
    health: Health
    health_reason: str | None
    health_since: datetime | None
    uuid: str | None
    perf: float = Field(description="Relative speed measured under load (1.0: nominal)")
    created_at: datetime


class NodeOut(OutModel):
    id: uuid.UUID
    rack_id: uuid.UUID
    name: str
    gpu_model: str
    cpu_milli: int
    memory_mib: int
    state: NodeState
    state_reason: str | None
    health: Health
    health_reason: str | None
    health_since: datetime | None
    nvlink_domain: str
    generation: int
    pool: str | None = Field(description="The operator's grouping for stacks and upgrades")
    stack_id: uuid.UUID | None = Field(description="The software stack it should run")
    drift: list[str] = Field(
        description="Each component its agent reports at another version than its stack pins "
        "(empty: none); a drifted node takes no gang"
    )
    production_at: datetime | None = Field(
        description="When its first burn-in passed (bring-up done); none without an agent"
    )
    created_at: datetime


class Holder(BaseModel):
    """A live allocation on a GPU: whose, at which tier, and how much of it."""

    workload_id: uuid.UUID
    tenant_id: uuid.UUID
    replica: int
    tier: str
    milli: int = Field(description="Per GPU: 1000 whole, a MIG slice's share, or a share's milli")
    gpu_memory_mib: int = Field(description="A fractional share's GPU memory (0 otherwise)")
    mig_profile: str | None = Field(description="The MIG profile (its generic key), if a slice")
    mig_slot: int | None = Field(description="The MIG slice's start slot, if a slice")


class GpuDetail(GpuOut):
    holders: list[Holder] = Field(description="Who holds it now (empty: idle)")
    free_milli: int = Field(description="Capacity left on it (milli-GPU)")


class NodeDetail(NodeOut):
    gpus: list[GpuDetail]


class NodeStateChange(StrictModel):
    state: NodeState
    reason: str | None = Field(None, max_length=500)


class FleetImportOut(OutModel):
    id: uuid.UUID
    status: ImportStatus
    source: str | None
    summary: dict | None
    error: str | None
    created_at: datetime
    finished_at: datetime | None


class FleetValidation(BaseModel):
    valid: bool
    totals: dict[str, int]


class CapacityRow(BaseModel):
    region: str
    gpu_model: str
    total_gpus: int
    free_gpus: int = Field(
        description="Whole GPUs free now: nothing allocated on them, ready node, healthy, "
        "not in MIG mode."
    )
    free_milli: int = Field(
        description="Fractional capacity left (milli-GPU) on the GPUs not in MIG mode."
    )
    free_mig: dict[str, int] = Field(
        description="Per MIG profile (the model's name), how many more instances of it alone "
        "the MIG GPUs could take now."
    )


class Capacity(BaseModel):
    items: list[CapacityRow]
