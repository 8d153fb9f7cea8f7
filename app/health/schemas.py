from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from app.core.schemas import OutModel, StrictModel, strict_schema

FIELD_PATTERN = r"^[A-Za-z_:][A-Za-z0-9_:]*$"
HOST_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
UUID_PATTERN = r"^GPU-[0-9A-Za-z-]{1,60}$"


def _names_a_gpu_schema(schema: dict) -> None:
    strict_schema(schema, TelemetrySample)
    # As the validator below says: node and gpu, or uuid (not null).
    schema["anyOf"] = [
        {"properties": {"uuid": {"type": "string", "pattern": UUID_PATTERN}}, "required": ["uuid"]},
        {
            "properties": {
                "node": {"type": "string", "pattern": HOST_PATTERN},
                "gpu": {"type": "integer", "minimum": 0, "maximum": 63},
            },
            "required": ["node", "gpu"],
        },
    ]


class TelemetrySample(StrictModel):
    """One DCGM field of one GPU. The GPU is named by its node and index, or by its UUID."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_names_a_gpu_schema)

    node: str | None = Field(
        None, max_length=63, pattern=HOST_PATTERN, description="The node's name (hostname)"
    )
    gpu: int | None = Field(None, ge=0, le=63, description="The GPU's index on the node")
    uuid: str | None = Field(
        None, max_length=64, pattern=UUID_PATTERN, description="DCGM's GPU UUID"
    )
    field: str = Field(
        max_length=100,
        pattern=FIELD_PATTERN,
        description="The DCGM field name, e.g. DCGM_FI_DEV_XID_ERRORS",
        examples=["DCGM_FI_DEV_XID_ERRORS"],
    )
    value: float = Field(ge=-1e19, le=1e19, description="As DCGM reads it (counters: 64-bit)")
    timestamp: AwareDatetime | None = Field(
        None, description="When the agent read it (default: when it arrives)"
    )

    @model_validator(mode="after")
    def _names_a_gpu(self) -> TelemetrySample:
        if self.uuid is None and (self.node is None or self.gpu is None):
            raise ValueError("name the GPU by node and gpu (its index), or by uuid")
        return self


class TelemetryBatch(StrictModel):
    samples: list[TelemetrySample] = Field(default_factory=list, max_length=500_000)
    nodes: list[Annotated[str, Field(max_length=63, pattern=HOST_PATTERN)]] = Field(
        default_factory=list,
        max_length=100_000,
        description="Nodes that report in without samples (a heartbeat).",
    )


class TelemetryProblem(BaseModel):
    sample: int | None = Field(
        description="The sample's position in `samples` (JSON) or its line (Prometheus text)"
    )
    node: str | None
    gpu: str | None
    uuid: str | None
    problem: str = Field(description="unknown_node | unknown_gpu")


RejectReason = Literal[
    "out_of_range", "not_finite", "future_timestamp", "bad_label", "uuid_conflict"
]


class TelemetryRejection(BaseModel):
    sample: int | None = Field(
        description="The sample's position in `samples` (JSON) or its line (Prometheus text)"
    )
    node: str | None = Field(description="null for a malformed label")
    gpu: str | None
    uuid: str | None
    field: str = Field(description="The DCGM field name")
    reason: RejectReason = Field(
        description=(
            "out_of_range: outside the field's domain (a negative counter, an Xid below 0 or "
            "past int32, a temperature no GPU reaches, a fraction where a whole number is "
            "read); not_finite: Inf, or NaN where a reading cannot be missing; "
            "future_timestamp: stamped more than 120 s ahead of the server's clock; bad_label: "
            "a control character in a label, or a malformed Hostname, gpu or UUID; "
            "uuid_conflict: the UUID is another GPU's"
        )
    )


class TelemetryResult(BaseModel):
    accepted: int = Field(description="Samples of fleet GPUs taken in")
    ignored: int = Field(description="Samples of fields the health loop does not use")
    unknown: list[TelemetryProblem] = Field(
        description="Samples naming no fleet GPU (the first 100); the rest were still taken in"
    )
    unknown_count: int
    rejected: int = Field(description="Samples rejected: never acted on; the rest were taken in")
    rejected_by_reason: dict[RejectReason, int] = Field(description="`rejected`, by reason")
    rejections: list[TelemetryRejection] = Field(description="The rejected samples (the first 100)")
    nodes: int = Field(description="Nodes that reported (a heartbeat each)")
    signals: int = Field(description="Fault signals raised, for the health loop to classify")


class HealthActionIn(StrictModel):
    action: Literal["quarantine", "release", "retire"] = Field(
        description=(
            "quarantine: out of the pool now, its work requeued ahead of its peers; release: "
            "back in service (through validation if it was out of service or unreachable); "
            "retire: out of service (RMA)"
        )
    )
    reason: str | None = Field(None, max_length=300)


class HealthActionOut(BaseModel):
    node_id: uuid.UUID
    gpu_index: int | None
    health: str


class HealthEventOut(OutModel):
    gpu_index: int | None = Field(description="null: the node itself")
    from_state: str
    to_state: str
    actor: str = Field(description="system (the health loop) | operator")
    cause: str
    incident_id: uuid.UUID | None
    details: dict
    at: datetime


class HealthHistory(BaseModel):
    items: list[HealthEventOut]


class OutItem(OutModel):
    node: str
    gpu_index: int | None = Field(description="null: the whole node is out")
    health: str
    reason: str | None
    since: datetime | None


class Allocation(BaseModel):
    allocated: int = Field(description="GPUs with work on them")
    idle: int = Field(description="Ready GPUs with nothing on them")
    unavailable: int = Field(description="GPUs out of the pool (health, or the node's state)")


class RackHealth(BaseModel):
    rack: str
    gpus: int
    by_health: dict[str, int]
    by_allocation: Allocation
    out: list[OutItem] = Field(description="What is out, or watched, and why")


class RegionHealth(BaseModel):
    region: str
    gpus: int
    by_health: dict[str, int]
    by_allocation: Allocation
    racks: list[RackHealth]


class IncidentOut(OutModel):
    id: uuid.UUID
    node: str | None
    region: str
    state: str = Field(description="open: signals may still join it (a burst); closed")
    opened_at: datetime
    last_signal_at: datetime
    signal: str
    xid: int | None
    action: str = Field(description="Its class: the action of its worst signal")
    what: str
    gpu_indices: list[int]
    signals: int
    held_back: str | None = Field(description="What the circuit breaker held back, if it did")


class FleetHealth(BaseModel):
    regions: list[RegionHealth]
    incidents: list[IncidentOut] = Field(
        description="Open incidents, and those of the circuit breaker's window, newest first"
    )


IdleCause = Literal["no_demand", "stranded", "unhealthy", "cordoned"]


class IdleRow(OutModel):
    start: datetime
    end: datetime
    region: str
    gpu_model: str
    cause: IdleCause = Field(
        description="no_demand: nothing waits for it; stranded: work that could use its model "
        "waits (quota, topology, fragmentation); unhealthy: out of the pool by the health "
        "loop; cordoned: an operator's cordon, drain or down"
    )
    gpu_hours: float


class IdleTotal(OutModel):
    cause: IdleCause
    gpu_hours: float


class IdleTimeOut(OutModel):
    """Idle GPU-hours by cause over time (recorded by the health sweep)."""

    from_: datetime = Field(..., alias="from")
    to: datetime
    granularity: Literal["hour", "day"]
    rows: list[IdleRow]
    totals: list[IdleTotal]

    model_config = ConfigDict(populate_by_name=True)


class BringUpNode(BaseModel):
    """A node on its way into service (or back): its burn-in, and why it may be stuck."""

    node: str
    region: str
    rack: str
    health: str
    state: str
    why: str = Field(description="bring-up | repair | return | upgrade, or what holds it")
    since: datetime | None = Field(description="When it began validating")
    step: str | None = Field(description="The burn-in step its agent runs now, if one")
    steps_done: int
    steps: int
    limit_at: datetime | None = Field(description="When an unfinished burn-in counts as failed")
    stuck: str | None = Field(description="Why it is not moving, if it is not; else null")


class BringUp(BaseModel):
    items: list[BringUpNode]
    stuck: int = Field(description="Of those, nodes that are not moving")
