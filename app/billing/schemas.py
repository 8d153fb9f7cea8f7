from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import AwareDatetime, Field, model_validator

from app.core.schemas import OutModel, PerCurrency, StrictModel, strict_schema
from app.placement.catalog import GPU_MODELS
from app.placement.isolation import Tier
from app.placement.mig import PROFILES, model_profile_names, profile_by_name, profile_names

GpuModelName = Literal[tuple(GPU_MODELS)]  # type: ignore[valid-type]
TierName = Literal[("*", *(t.label for t in Tier))]  # type: ignore[valid-type]


_GENERIC_SHAPES = ["whole", "fractional", "vm", "mig", *(f"mig-{k}" for k in PROFILES)]
_MIG_NAMES = profile_names()
PriceShape = Literal[  # type: ignore[valid-type]
    tuple([*_GENERIC_SHAPES, *sorted(f"mig-{n}" for n in _MIG_NAMES)])
]


def _price_rules(schema: dict[str, Any], model: type) -> None:
    """A model's own MIG profile name goes with that model (`mig-3g.40gb` with an H100, not a
    B200): stated as anyOf, as `PriceIn._one_vocabulary` checks it."""
    strict_schema(schema, model)
    groups: dict[frozenset[str], list[str]] = {}
    for name, models in _MIG_NAMES.items():
        groups.setdefault(models, []).append(f"mig-{name}")
    schema["anyOf"] = [{"properties": {"shape": {"enum": _GENERIC_SHAPES}}}] + [
        {"properties": {"shape": {"enum": sorted(names)}, "gpu_model": {"enum": sorted(m)}}}
        for m, names in sorted(groups.items(), key=lambda kv: sorted(kv[1]))
    ]


class PriceIn(StrictModel):
    model_config = {**StrictModel.model_config, "json_schema_extra": _price_rules}

    gpu_model: GpuModelName  # type: ignore[valid-type]
    shape: PriceShape = Field(  # type: ignore[valid-type]
        ...,
        description="whole, fractional, vm, mig (any profile), or one MIG profile: by its "
        "generic key (`mig-3g`) or the model's name (`mig-3g.40gb`), stored as the key, the "
        "vocabulary of the usage ledger",
    )
    tier: TierName = "*"  # type: ignore[valid-type]
    region: str = Field("*", min_length=1, max_length=63)
    plan: Literal["on_demand", "reserved", "preemptible"]
    currency: str = Field(..., pattern=r"^[a-z]{3}$", description="ISO 4217, lower case")
    unit_amount: int = Field(
        ..., ge=0, le=10**9, description="Minor units (cents) per GPU-hour of GPU-equivalents"
    )
    effective_from: AwareDatetime

    @model_validator(mode="after")
    def _one_vocabulary(self) -> PriceIn:
        if self.shape.startswith("mig-"):
            try:
                key = profile_by_name(self.gpu_model, self.shape[4:]).key
            except KeyError:
                valid = [
                    *_GENERIC_SHAPES,
                    *(f"mig-{n}" for n in model_profile_names(self.gpu_model)),
                ]
                raise ValueError(
                    f"{self.shape!r} is not a shape of {self.gpu_model}; valid: " + ", ".join(valid)
                ) from None
            self.shape = f"mig-{key}"
        return self


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
    totals: PerCurrency = Field(..., description="Minor units per currency")
    unpriced_milli_gpu_ms: int


def _some_limit_schema(schema: dict[str, Any], model: type) -> None:
    strict_schema(schema, model)
    # At least one limit that is a number (not null).
    schema["anyOf"] = [
        {"required": [f], "properties": {f: schema["properties"][f]["anyOf"][0]}}
        for f in ("spend_limit", "gpu_hour_limit")
    ]


class BudgetIn(StrictModel):
    model_config = {**StrictModel.model_config, "json_schema_extra": _some_limit_schema}

    currency: str = Field("usd", pattern=r"^[a-z]{3}$", description="Currency of the spend limit")
    spend_limit: int | None = Field(
        None, ge=0, le=10**15, description="Minor units per month (e.g. cents); null: no limit"
    )
    gpu_hour_limit: int | None = Field(
        None, ge=0, le=10**9, description="GPU-hours (GPU-equivalents) per month; null: no limit"
    )
    stop_preemptible: bool = Field(
        False, description="At a limit, also stop running preemptible workloads"
    )

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetIn:
        if self.spend_limit is None and self.gpu_hour_limit is None:
            raise ValueError("set spend_limit, gpu_hour_limit or both")
        return self


class BudgetAlertOut(OutModel):
    period: str
    metric: Literal["spend", "gpu_hours"]
    threshold_pct: int
    used: int = Field(description="Minor units for spend, milli-GPU-ms for gpu_hours")
    limit: int = Field(description="Same unit as `used`")
    created_at: datetime


class BudgetOut(OutModel):
    tenant_id: uuid.UUID
    currency: str
    spend_limit: int | None
    gpu_hour_limit: int | None
    stop_preemptible: bool
    period: str | None = Field(description="The month last evaluated")
    spent: int = Field(description="Minor units spent this month (priced as the bill prices)")
    gpu_hours_used: float
    exhausted: bool = Field(description="A limit is reached: new submissions are refused")
    evaluated_at: datetime | None
    alerts: list[BudgetAlertOut] = Field(description="Thresholds crossed this month")


class ReconciliationRow(OutModel):
    tenant_id: uuid.UUID
    stripe_customer_id: str
    meter: str
    ledger_milli_gpu_ms: int
    exported_milli_gpu_ms: int = Field(description="In meter events Stripe took (not cancelled)")
    adjusted_milli_gpu_ms: int = Field(description="Credits and charges outside Stripe's windows")
    difference_milli_gpu_ms: int = Field(description="ledger - exported - adjusted; 0 is right")
    pending_events: int = Field(description="Meter events or cancellations still to send")
    failed_events: int = Field(description="Meter events Stripe refused (an operator acts)")


class Reconciliation(OutModel):
    period: str
    start: datetime
    through: datetime = Field(description="End of the last bucket old enough to be exported")
    rows: list[ReconciliationRow]
    differences: int = Field(description="Rows whose difference is not zero")


class CommitmentIn(StrictModel):
    gpu_model: GpuModelName  # type: ignore[valid-type]
    region: str = Field("*", min_length=1, max_length=63, description="A region, or '*' for any")
    gpus: int = Field(
        ..., ge=1, le=100_000, description="GPU-equivalents reserved in every hour of the term"
    )
    starts_at: AwareDatetime = Field(..., description="On a whole hour (UTC)")
    ends_at: AwareDatetime = Field(..., description="On a whole hour (UTC), after starts_at")
    reference: str | None = Field(None, max_length=200, description="e.g. the contract number")


class CommitmentOut(OutModel):
    id: uuid.UUID
    tenant_id: uuid.UUID
    gpu_model: str
    region: str
    gpus_milli: int = Field(description="milli-GPU-equivalents reserved in every hour")
    starts_at: datetime
    ends_at: datetime
    reference: str | None
    created_at: datetime


class CommitmentList(OutModel):
    items: list[CommitmentOut]
