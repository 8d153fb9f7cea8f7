from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, Field

from app.core.schemas import OutModel, StrictModel
from app.placement.catalog import GPU_MODELS
from app.placement.isolation import Tier

GpuModelName = Literal[tuple(GPU_MODELS)]  # type: ignore[valid-type]
TierName = Literal[("*", *(t.label for t in Tier))]  # type: ignore[valid-type]


class PriceIn(StrictModel):
    gpu_model: GpuModelName  # type: ignore[valid-type]
    shape: str = Field(
        ...,
        pattern=r"^(whole|fractional|vm|mig|mig-[0-9a-z.+]{2,16})$",
        description="whole, fractional, vm, mig (any profile) or mig-<profile>",
    )
    tier: TierName = "*"  # type: ignore[valid-type]
    region: str = Field("*", min_length=1, max_length=63)
    plan: Literal["on_demand", "reserved", "preemptible"]
    currency: str = Field(..., pattern=r"^[a-z]{3}$", description="ISO 4217, lower case")
    unit_amount: int = Field(
        ..., ge=0, le=10**9, description="Minor units (cents) per GPU-hour of GPU-equivalents"
    )
    effective_from: AwareDatetime


class PriceOut(OutModel):
    id: uuid.UUID
    gpu_model: str
    shape: str
    tier: str
    region: str
    plan: str
    currency: str
    unit_amount: int
    version: int
    effective_from: datetime
    created_at: datetime


class PriceList(OutModel):
    items: list[PriceOut]


class BillingLine(OutModel):
    tenant_id: uuid.UUID
    sku: str = Field(..., description="<gpu_model>/<shape>")
    gpu_model: str
    shape: str
    tier: str
    region: str
    plan: str
    milli_gpu_ms: int
    gpu_hours: float
    unit_amount: int | None = Field(..., description="None: no price covers this usage")
    currency: str | None
    price_version: int | None
    amount: int = Field(..., description="Minor units, rounded once per line")


class BillingSummary(OutModel):
    period: str
    start: datetime
    end: datetime
    accrued_until: datetime
    lines: list[BillingLine]
    totals: dict[str, int] = Field(..., description="Minor units per currency")
    unpriced_milli_gpu_ms: int
