from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator

from app.core.db import utcnow
from app.core.schemas import OutModel, StrictModel

TenantScope = Literal["read", "write", "admin"]


class KeyCreate(StrictModel):
    name: str = Field(..., min_length=1, max_length=200)
    scopes: list[TenantScope] = Field(default_factory=lambda: ["read", "write"], min_length=1)
    expires_at: datetime | None = Field(
        None, description="Optional expiry (RFC 3339, with offset)."
    )

    @field_validator("scopes")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("expires_at")
    @classmethod
    def _future(cls, v: datetime | None) -> datetime | None:
        if v is not None:
            if v.tzinfo is None:
                raise ValueError("expires_at needs a timezone offset")
            if v <= utcnow():
                raise ValueError("expires_at must be in the future")
        return v


class KeyOut(OutModel):
    id: uuid.UUID
    tenant_id: uuid.UUID | None
    name: str
    prefix: str = Field(description="Public id of the key: the 8 characters after `rp_`.")
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="The secret API key. Shown once; only a hash is stored.")


class SignupKey(KeyOut):
    key: str | None = Field(
        description="The secret API key, shown once. Null when an `Idempotency-Key` replays the "
        "signup: a replay proves nothing about who sends it, so it never repeats a secret."
    )
