from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import BaseModel, Field

from app.core.schemas import StrictModel


class SignIn(StrictModel):
    api_key: str = Field(
        min_length=1,
        max_length=200,
        description="The key to sign in with. It is checked once and not kept: the session "
        "acts as the key does (revoking the key ends its sessions).",
    )


class SessionOut(BaseModel):
    """The signed-in browser session (its token is only in the HttpOnly cookie)."""

    id: uuid.UUID
    tenant_id: uuid.UUID | None = Field(description="None: an operator's session")
    operator: bool
    key_prefix: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime = Field(description="When the session ends whatever its use")
    idle_timeout_seconds: float = Field(description="It ends after this long unused")
    csrf_token: str = Field(
        description="Send it as the `X-CSRF-Token` header on every request that is not a "
        "GET, HEAD or OPTIONS (GraphQL POSTs included)"
    )
