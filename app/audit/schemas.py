from __future__ import annotations

import uuid
from datetime import datetime

from pydantic import Field

from app.core.schemas import OutModel


class AuditEntryOut(OutModel):
    id: uuid.UUID
    created_at: datetime
    principal: str = Field(description="tenant, operator, system or anonymous")
    key_id: uuid.UUID | None = Field(description="The acting key (never its secret)")
    key_prefix: str | None
    tenant_id: uuid.UUID | None
    action: str = Field(description='"METHOD /route/{template}", or a system action')
    target_type: str | None
    target_id: str | None
    request_id: str | None
    status: int | None = Field(description="The HTTP status the request was answered with")
    details: dict


class AdminAuditEntryOut(AuditEntryOut):
    internal: dict = Field(description="What names other tenants' objects (operators only)")
