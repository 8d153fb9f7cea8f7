from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.schemas import PageParams, paginate
from app.keys.schemas import KeyCreated, KeyOut
from app.models.keys import ApiKey
from app.tenancy.credentials import generate_key
from app.tenancy.principal import PLATFORM_SCOPE, AuthContext
from app.tenancy.scoping import restrict, scoped_select


def create_key(
    session: Session,
    *,
    tenant_id: uuid.UUID | None,
    name: str,
    scopes: list[str],
    expires_at: datetime | None = None,
) -> KeyCreated:
    """Create a key and return it with its secret (the only time the secret exists in clear)."""
    if tenant_id is None and scopes != [PLATFORM_SCOPE]:
        raise ValueError("platform keys carry exactly the platform scope")
    full, prefix, digest = generate_key()
    key = ApiKey(
        tenant_id=tenant_id,
        name=name,
        prefix=prefix,
        secret_hash=digest,
        scopes=scopes,
        expires_at=expires_at,
        created_at=utcnow(),
    )
    session.add(key)
    session.flush()
    return KeyCreated(**KeyOut.model_validate(key).model_dump(), key=full)


def revoke(key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = utcnow()
    return key


def list_keys(
    session: Session, auth: AuthContext, page: PageParams, *, tenant_id: uuid.UUID | None = None
) -> tuple[list[ApiKey], str | None]:
    """The keys `auth` may read (its tenant's; every key for operators, or one tenant's with
    `tenant_id`), oldest first, a page at a time."""
    stmt = scoped_select(auth, ApiKey)
    if tenant_id is not None:
        stmt = restrict(tenant_id, stmt, ApiKey)
    return paginate(session, stmt, ApiKey, page)
