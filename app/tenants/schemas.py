from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from email_validator import EmailNotValidError, validate_email
from pydantic import AfterValidator, Field, WithJsonSchema, field_validator

from app.core.schemas import OutModel, StrictModel
from app.models.tenants import IsolationTier, TenantStatus

Slug = Annotated[
    str,
    Field(
        min_length=2,
        max_length=63,
        pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
        description="Lower-case letters, digits and dashes; unique.",
    ),
]
Name = Annotated[str, Field(min_length=1, max_length=200)]


def _email(value: str) -> str:
    # Syntax only (no DNS), and reserved test domains allowed: the schema says `format: email`.
    try:
        return validate_email(value, check_deliverability=False, test_environment=True).normalized
    except EmailNotValidError as exc:
        raise ValueError(f"value is not a valid email address: {exc}") from None


EmailStr = Annotated[
    str,
    Field(max_length=254),
    AfterValidator(_email),
    WithJsonSchema({"type": "string", "format": "email", "maxLength": 254}),
]


def _dedupe(tiers: list[IsolationTier] | None) -> list[IsolationTier] | None:
    if tiers is None:
        return None
    if not tiers:
        raise ValueError("an isolation policy must allow at least one tier")
    return list(dict.fromkeys(tiers))


class TenantCreate(StrictModel):
    name: Name
    slug: Slug
    contact_email: EmailStr
    isolation_policy: list[IsolationTier] | None = Field(
        None,
        min_length=1,
        description="Tiers the tenant may use; default: shared tiers, dedicated GPUs and VMs.",
    )
    status: TenantStatus = TenantStatus.active

    _v = field_validator("isolation_policy")(_dedupe)


class SignupRequest(StrictModel):
    name: Name
    slug: Slug
    contact_email: EmailStr


class TenantUpdate(StrictModel):
    name: Name | None = None
    contact_email: EmailStr | None = None
    isolation_policy: list[IsolationTier] | None = Field(None, min_length=1)
    status: TenantStatus | None = None

    _v = field_validator("isolation_policy")(_dedupe)


class TenantOut(OutModel):
    id: uuid.UUID
    slug: str
    name: str
    contact_email: str
    status: TenantStatus
    isolation_policy: list[IsolationTier]
    stripe_customer_id: str | None = Field(
        None, description="The Stripe customer billed for this tenant (set after onboarding)"
    )
    created_at: datetime
