from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from app.core.schemas import OutModel, StrictModel, strict_schema
from app.health.states import Health
from app.models.fleet import ImportStatus, NodeState
from app.stacks.schemas import NAME as STACK_NAME


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


class MigSlotOut(BaseModel):
    profile: str = Field(description="The generic key (1g, 2g, 3g, 4g, 7g, 1g.2m)")
    start: int = Field(description="Its first memory slice")


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
    mig_layout: list[MigSlotOut] | None = Field(
        None,
        description="A MIG GPU's instances as its agent laid them out (none where nothing "
        "lays instances out: placement picks starts freely)",
    )
    relayout_pending: bool = Field(
        False, description="A MIG layout is being applied: it takes no work until then"
    )
    created_at: datetime

    @field_validator("mig_layout", mode="before")
    @classmethod
    def _slots(cls, value: Any) -> Any:
        if isinstance(value, list):  # as stored: [[profile key, start], ...]
            return [
                {"profile": v[0], "start": v[1]} if isinstance(v, list | tuple) else v
                for v in value
            ]
        return value


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


def _one_scope(schema: dict, model: type) -> None:
    """`UpgradeCreate`'s rule in its JSON Schema: exactly one of region or pool."""
    strict_schema(schema, model)
    null = {"type": "null"}
    name = {"type": "string", "pattern": STACK_NAME}
    schema["oneOf"] = [
        {"required": [k], "properties": {k: name, o: null}}
        for k, o in (("region", "pool"), ("pool", "region"))
    ]


class UpgradeCreate(StrictModel):
    """A rolling upgrade of one region's or one pool's nodes to a software stack."""

    model_config = {**StrictModel.model_config, "json_schema_extra": _one_scope}

    stack: str = Field(min_length=1, max_length=63, pattern=STACK_NAME)
    region: str | None = Field(None, min_length=1, max_length=63, pattern=STACK_NAME)
    pool: str | None = Field(None, min_length=1, max_length=63, pattern=STACK_NAME)
    batch: str = Field(
        "1",
        max_length=6,
        pattern=r"^([1-9][0-9]{0,4}|([1-9][0-9]?|100)%)$",
        description="Units (a node, or an NVLink domain's nodes) upgraded at once: N, or N% "
        "of the units",
    )
    max_unavailable_pct: float = Field(
        10.0,
        gt=0,
        le=100,
        description="At most this share of the scope's GPUs out of service at once (faults "
        "and cordons included); a unit may always start when nothing else is out",
    )
    max_failures: int = Field(1, ge=1, le=10_000, description="Failed nodes that pause the upgrade")
    drain_wait_s: int = Field(
        1800,
        ge=0,
        le=86_400,
        description="Longest wait for work to move at its next checkpoint before the node "
        "drains (the preemption grace then holds)",
    )

    @model_validator(mode="after")
    def _one_scope(self) -> UpgradeCreate:
        if (self.region is None) == (self.pool is None):
            raise ValueError("give exactly one of region or pool")
        return self


UPGRADE_PHASES = ("pending", "draining", "applying", "done", "failed", "skipped", "rolled_back")


class UpgradeNodeOut(BaseModel):
    node: str
    unit: int = Field(description="Nodes of one unit (an NVLink domain) move together")
    phase: str = Field(description=" | ".join(UPGRADE_PHASES))
    detail: str | None = Field(description="Why it failed or was skipped")
    from_stack: str | None = Field(description="The stack it ran before (a rollback's target)")
    work_moved: int = Field(description="Workloads moved off it")
    taken_at: datetime | None
    back_at: datetime | None


class UpgradeReport(BaseModel):
    nodes: int
    gpu_hours_out_of_service: float = Field(
        description="GPUs x time each node was out for it (until now for nodes still out)"
    )
    work_moved: int = Field(description="Workloads moved off its nodes")
    failures: int


class UpgradeProgress(BaseModel):
    pending: int = 0
    draining: int = 0
    applying: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    rolled_back: int = 0


class UpgradeOut(OutModel):
    id: uuid.UUID
    stack: str
    scope_kind: str = Field(description="region | pool")
    scope: str
    batch: str
    units_at_once: int
    max_unavailable_pct: float
    max_failures: int
    drain_wait_s: int
    state: str = Field(description="running | paused | done | rolling_back | rolled_back")
    state_reason: str | None
    requested_by: str | None
    created_at: datetime
    finished_at: datetime | None
    progress: UpgradeProgress = Field(description="Nodes in each phase")
    report: UpgradeReport
    nodes: list[UpgradeNodeOut] = Field(description="Every node (empty in lists)")


class UpgradeList(BaseModel):
    items: list[UpgradeOut]
