"""Who is calling and what they may do: the AuthContext every handler receives, the scopes,
and the one check of a scope."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from app.core.errors import Forbidden

# Scopes. Tenant keys: read < write < admin (each implies those before it). Operators: platform.
# `invoke`: calling the tenant's inference endpoints through the gateway (app/gateway), and
# nothing else; only `admin` implies it, so a key handed to an application that calls a model
# reads and changes nothing, and a key that manages the account calls no model unless meant to.
TENANT_SCOPES = ("read", "write", "admin", "invoke")

PLATFORM_SCOPE = "platform"

_IMPLIED = {
    "admin": {"admin", "write", "read", "invoke"},
    "write": {"write", "read"},
    "read": {"read"},
    "invoke": {"invoke"},
}


@dataclass(frozen=True)
class AuthContext:
    """Who is calling: the key, its tenant (None for operators) and its scopes."""

    key_id: uuid.UUID
    key_prefix: str
    tenant_id: uuid.UUID | None
    scopes: frozenset[str] = field(default_factory=frozenset)
    tenant_status: str | None = None
    # What submissions are checked against, read with the key: the tenant's isolation policy
    # (tiers it allows; None: the default), hard limits in GPU-milli per model (None: no limit)
    # and the month its budget was found exhausted in.
    tenant_isolation: tuple[str, ...] | None = None
    quota_limits: tuple[tuple[str, int | None], ...] = ()
    budget_exhausted: str | None = None

    @property
    def is_platform(self) -> bool:
        return PLATFORM_SCOPE in self.scopes

    def has(self, scope: str) -> bool:
        return any(scope in _IMPLIED.get(s, {s}) for s in self.scopes)


# Background jobs (beat tasks, CLI commands) act as the platform; they narrow by tenant themselves.
SYSTEM = AuthContext(uuid.UUID(int=0), "system", None, frozenset({PLATFORM_SCOPE}))


def require_tenant_scope(auth: AuthContext, scope: str, *, allow_inactive: bool = False) -> None:
    """The one check of a tenant key's scope (REST dependencies and GraphQL resolvers)."""
    if auth.tenant_id is None:
        raise Forbidden(
            "This acts on a tenant's own resources; use a tenant API key.",
            code="tenant_key_required",
        )
    if not allow_inactive and auth.tenant_status != "active":
        needs = "reactivate" if auth.tenant_status == "suspended" else "approve"
        raise Forbidden(
            f"The tenant is {auth.tenant_status}; an operator must {needs} it first.",
            code="tenant_not_active",
        )
    if not auth.has(scope):
        raise Forbidden(f"This action needs the `{scope}` scope.", code="insufficient_scope")


def require_reader(auth: AuthContext) -> None:
    """A tenant's key with `read`, or an operator's: the subjects of the questions both ask
    (the price book, usage, a month's export, capacity). What each one sees is its own scope's:
    the service narrows by `restrict`, as Polar's readable statements do."""
    if not auth.is_platform:
        require_tenant_scope(auth, "read")


def require_platform(auth: AuthContext) -> None:
    if not auth.is_platform:
        raise Forbidden(
            "This is for operators; it needs a key with the `platform` scope.",
            code="platform_scope_required",
        )
