"""API-key authentication and the AuthContext every handler receives."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware, session_dependency, utcnow
from app.core.errors import Forbidden, Unauthorized

KEY_PREFIX = "rp_"
PREFIX_LEN = 8
SECRET_LEN = 40
_ALPHABET = string.ascii_letters + string.digits

# Scopes. Tenant keys: read < write < admin (each implies those before it). Operators: platform.
TENANT_SCOPES = ("read", "write", "admin")
PLATFORM_SCOPE = "platform"
_IMPLIED = {"admin": {"admin", "write", "read"}, "write": {"write", "read"}, "read": {"read"}}

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer rp_...`")
_header = APIKeyHeader(
    name="X-API-Key", auto_error=False, description="API key (alternative header)"
)


def generate_key() -> tuple[str, str, str]:
    """Return (full key, public prefix, secret hash). The full key is shown once, never stored."""
    prefix = "".join(secrets.choice(_ALPHABET) for _ in range(PREFIX_LEN))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LEN))
    full = f"{KEY_PREFIX}{prefix}{secret}"
    return full, prefix, hash_secret(full)


def hash_secret(full_key: str) -> str:
    pepper = get_settings().key_pepper.encode()
    return hmac.new(pepper, full_key.encode(), hashlib.sha256).hexdigest()


def parse_prefix(full_key: str) -> str | None:
    if (
        not full_key.startswith(KEY_PREFIX)
        or len(full_key) != len(KEY_PREFIX) + PREFIX_LEN + SECRET_LEN
    ):
        return None
    if not all(c in _ALPHABET for c in full_key[len(KEY_PREFIX) :]):
        return None
    return full_key[len(KEY_PREFIX) : len(KEY_PREFIX) + PREFIX_LEN]


@dataclass(frozen=True)
class AuthContext:
    """Who is calling: the key, its tenant (None for operators) and its scopes."""

    key_id: uuid.UUID
    key_prefix: str
    tenant_id: uuid.UUID | None
    scopes: frozenset[str] = field(default_factory=frozenset)
    tenant_status: str | None = None

    @property
    def is_platform(self) -> bool:
        return PLATFORM_SCOPE in self.scopes

    def has(self, scope: str) -> bool:
        return any(scope in _IMPLIED.get(s, {s}) for s in self.scopes)


# Background jobs (beat tasks, CLI commands) act as the platform; they narrow by tenant themselves.
SYSTEM = AuthContext(uuid.UUID(int=0), "system", None, frozenset({PLATFORM_SCOPE}))


def extract_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    return request.headers.get("x-api-key")


def authenticate(
    request: Request,
    _b: HTTPAuthorizationCredentials | None = Depends(_bearer),
    _h: str | None = Depends(_header),
    session: Session = Depends(session_dependency),
) -> AuthContext:
    from app.keys.models import ApiKey
    from app.tenants.models import Tenant

    raw = extract_key(request)
    if not raw:
        raise Unauthorized(
            "Send an API key as `Authorization: Bearer rp_...`.", code="missing_api_key"
        )
    prefix = parse_prefix(raw)
    if prefix is None:
        raise Unauthorized("The API key is malformed.", code="invalid_api_key")
    # The key and its tenant in one round trip; the tenant stays in the session's identity
    # map for the route (`get_owned` finds it there).
    row = session.execute(
        select(ApiKey, Tenant)
        .outerjoin(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.prefix == prefix)
    ).first()
    key, tenant = (row[0], row[1]) if row is not None else (None, None)
    # Compare even when the prefix is unknown, so timing does not reveal which prefixes exist.
    expected = key.secret_hash if key is not None else "0" * 64
    if not hmac.compare_digest(expected, hash_secret(raw)) or key is None:
        raise Unauthorized("The API key is invalid.", code="invalid_api_key")
    now = utcnow()
    if key.revoked_at is not None:
        raise Unauthorized("The API key has been revoked.", code="revoked_api_key")
    if key.expires_at is not None and as_aware(key.expires_at) <= now:
        raise Unauthorized("The API key has expired.", code="expired_api_key")
    # Keep last_used_at fresh to the minute without writing on every request.
    if key.last_used_at is None or now - as_aware(key.last_used_at) > timedelta(seconds=60):
        key.last_used_at = now
    # The identity map holds rows weakly: keep the tenant for the route's `get_owned`.
    session.info["rackplane_auth_tenant"] = tenant
    tenant_status = tenant.status if tenant is not None else None
    ctx = AuthContext(key.id, key.prefix, key.tenant_id, frozenset(key.scopes), tenant_status)
    request.state.auth = ctx
    return ctx


def _tenant_scope(scope: str, *, allow_inactive: bool = False):
    async def dependency(auth: AuthContext = Depends(authenticate)) -> AuthContext:
        # async: a check without I/O, run on the event loop rather than a thread-pool hop
        if auth.tenant_id is None:
            raise Forbidden(
                "This route acts on a tenant's own resources; use a tenant API key.",
                code="tenant_key_required",
            )
        if not allow_inactive and auth.tenant_status != "active":
            raise Forbidden(
                f"The tenant is {auth.tenant_status}; an operator must approve it first.",
                code="tenant_not_active",
            )
        if not auth.has(scope):
            raise Forbidden(f"This action needs the `{scope}` scope.", code="insufficient_scope")
        return auth

    return dependency


async def _platform(auth: AuthContext = Depends(authenticate)) -> AuthContext:
    if not auth.is_platform:
        raise Forbidden(
            "This is an operator route; it needs a key with the `platform` scope.",
            code="platform_scope_required",
        )
    return auth


tenant_read = _tenant_scope("read")
tenant_read_any_status = _tenant_scope("read", allow_inactive=True)
tenant_write = _tenant_scope("write")
tenant_admin = _tenant_scope("admin")
platform = _platform
