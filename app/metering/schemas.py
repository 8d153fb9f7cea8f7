from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, ConfigDict, Field, model_validator

from app.core.schemas import OutModel, StrictModel


class UsageEventIn(StrictModel):
    """One allocation lifecycle event, or a correction. The key makes ingestion idempotent: a
    key already in the ledger is skipped, whatever the repeat carries."""

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
        ge=-(2**62),
        le=2**62,
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
