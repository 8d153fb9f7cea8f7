from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import AwareDatetime, ConfigDict, Field, model_validator

from app.core.schemas import MAX_JSON_INT, OutModel, StrictModel, strict_schema


def _event_rules(schema: dict[str, Any], model: type) -> None:
    strict_schema(schema, model)
    schema["anyOf"] = [  # the rules of `_consistent`, stated
        {
            "required": ["quantity"],
            "properties": {
                "kind": {"const": "adjustment"},
                "quantity": schema["properties"]["quantity"]["anyOf"][0],
            },
        },
        {
            "required": ["allocation_id"],
            "properties": {
                "kind": {"enum": ["start", "stop"]},
                "allocation_id": {"type": "string", "format": "uuid"},
                "quantity": {"type": "null"},
            },
        },
    ]


class UsageEventIn(StrictModel):
    """One allocation lifecycle event, or a correction. The key makes ingestion idempotent: a
    key already in the ledger is skipped, whatever the repeat carries."""

    model_config = {**StrictModel.model_config, "json_schema_extra": _event_rules}

    event_key: str = Field(..., min_length=1, max_length=200)
    kind: Literal["start", "stop", "adjustment"]
    allocation_id: uuid.UUID | None = Field(
        None, description="Required for start and stop: they pair by allocation."
    )
    workload_id: uuid.UUID | None = None
    tenant_id: uuid.UUID
    region: str = Field(..., min_length=1, max_length=63)
    gpu_model: str = Field(..., min_length=1, max_length=32)
    shape: str = Field(
        ..., min_length=1, max_length=24, description="whole, mig-<profile>, fractional or vm"
    )
    tier: str = Field(..., min_length=1, max_length=24)
    priority: str = Field(..., min_length=1, max_length=24)
    gpu_milli: int = Field(..., ge=0, le=1_000_000, description="GPU-equivalents held, milli-GPU")
    occurred_at: AwareDatetime
    quantity: int | None = Field(
        None,
        ge=-MAX_JSON_INT,
        le=MAX_JSON_INT,
        description="Adjustments only: signed milli-GPU-milliseconds.",
    )
    reason: str | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _consistent(self) -> UsageEventIn:
        if self.kind == "adjustment":
            if self.quantity is None:
                raise ValueError("an adjustment needs a quantity")
        elif self.quantity is not None:
            raise ValueError("only adjustments carry a quantity")
        elif self.allocation_id is None:
            raise ValueError(f"a {self.kind} event needs its allocation_id")
        return self


class UsageEventBatch(StrictModel):
    events: list[UsageEventIn] = Field(..., min_length=1, max_length=5000)


class IngestOut(OutModel):
    received: int
    new: int = Field(..., description="Events not already in the ledger")


class UsageRow(OutModel):
    start: datetime
    end: datetime
    group: dict[str, str | None]
    milli_gpu_ms: int = Field(..., description="Exact usage: milli-GPU x milliseconds")
    gpu_hours: float = Field(..., description="The same, in GPU-hours (for display)")


class UsageOut(OutModel):
    from_: datetime = Field(..., alias="from")
    to: datetime
    granularity: Literal["hour", "day"]
    group_by: list[str]
    rows: list[UsageRow]
    total_milli_gpu_ms: int
    total_gpu_hours: float

    model_config = ConfigDict(populate_by_name=True)


class UtilisationRow(OutModel):
    start: datetime
    end: datetime
    region: str
    gpu_model: str
    capacity_gpu_hours: float
    allocated_gpu_hours: float
    idle_gpu_hours: float
    utilisation_pct: float


class UtilisationOut(OutModel):
    from_: datetime = Field(..., alias="from")
    to: datetime
    granularity: Literal["hour", "day"]
    rows: list[UtilisationRow]
    capacity_gpu_hours: float
    allocated_gpu_hours: float
    idle_gpu_hours: float
    utilisation_pct: float

    model_config = ConfigDict(populate_by_name=True)
