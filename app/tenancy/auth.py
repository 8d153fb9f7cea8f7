"""Authentication at the edge: a request's credential (API key header or session cookie with
its CSRF check), and the FastAPI dependencies that give handlers their AuthContext
(`TenantRead`, `TenantWrite`, `TenantAdmin`, `Platform`)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from app.core.errors import AppError, Forbidden, Unauthorized
from app.ratelimit import service as ratelimit
from app.tenancy.credentials import csrf_token
from app.tenancy.principal import (
    AuthContext,
    require_platform,
    require_reader,
    require_tenant_scope,
)
from app.tenancy.principals import resolve_key, resolve_session

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer rp_...`")

_header = APIKeyHeader(
    name="X-API-Key", auto_error=False, description="API key (alternative header)"
)


def extract_key(request: HTTPConnection) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    return request.headers.get("x-api-key")


# --- browser sessions ---------------------------------------------------------------------------
# The portal trades an API key for a session once (app/sessions): the page never keeps the key.
# The session's token lives in an HttpOnly cookie; a request it authenticates that may change
# something (any method but GET/HEAD/OPTIONS, so every GraphQL POST) must also carry the
# session's CSRF token in a header, which a page on another site can neither read nor forge.
SESSION_COOKIE = "rp_session"

CSRF_HEADER = "X-CSRF-Token"

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Credential:
    """What a request authenticates with: an API key, or a browser session's token."""

    kind: str  # "key" | "session"
    raw: str

    async def resolve(
        self, before_lookup: Callable[[], None] | None = None, address: str | None = None
    ) -> AuthContext:
        """Its AuthContext; `before_lookup` runs first when the database must be asked (from
        `address`: see `resolve_key`)."""
        if self.kind == "key":
            return await resolve_key(self.raw, before_lookup, address)
        return await resolve_session(self.raw, before_lookup)


def credential_of(conn: HTTPConnection) -> Credential | None:
    """A request's credential: its API key header, else its session cookie."""
    raw = extract_key(conn)
    if raw:
        return Credential("key", raw)
    if conn.headers.get("authorization"):  # a malformed header is a key, never a cookie
        return None
    token = conn.cookies.get(SESSION_COOKIE)
    return Credential("session", token) if token else None


def check_csrf(conn: HTTPConnection, cred: Credential) -> None:
    """A session-authenticated request that may change something must carry the CSRF token."""
    if cred.kind != "session" or conn.scope.get("method", "GET") in SAFE_METHODS:
        return
    sent = conn.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(sent.encode(), csrf_token(cred.raw).encode()):
        raise Forbidden(
            f"A browser session's request must carry its `{CSRF_HEADER}` header.",
            code="csrf_token_invalid",
        )


AUTH_ERROR = "auth_error"

# Told who is calling once a request is authenticated (the audit log registers here: it sits
# above authentication and reads the request's credential itself).
_ON_AUTHENTICATED: list[Callable[[AuthContext], None]] = []


def on_authenticated(hook: Callable[[AuthContext], None]) -> Callable[[AuthContext], None]:
    if hook not in _ON_AUTHENTICATED:
        _ON_AUTHENTICATED.append(hook)
    return hook


def charge_anonymous(conn: HTTPConnection, cost: int = 1) -> None:
    """Take from the caller's address's `anonymous` bucket (cost 0: only check one is left):
    a request with no credential, or one whose credential failed, is paid for here."""
    ratelimit.check(conn.scope, "anonymous", address=ratelimit.client_address(conn), cost=cost)


async def context_of(conn: HTTPConnection) -> AuthContext | None:
    """The caller of a request (None without any credential): its key, or its session with the
    CSRF check. The one place a request's credential is checked, once per request (a refusal
    is kept and raised again to whoever asks next).

    A credential that fails costs its address a token of the `anonymous` class; once the
    address has none left, a credential this process has not cached is refused (429) before
    the database is asked."""
    state = conn.scope.setdefault("state", {})
    if AUTH_ERROR in state:
        raise state[AUTH_ERROR]
    cred = credential_of(conn)
    if cred is None:
        return None
    try:
        try:
            ctx = await cred.resolve(
                lambda: charge_anonymous(conn, cost=0), ratelimit.client_address(conn)
            )
        except Unauthorized:
            charge_anonymous(conn)
            raise
        check_csrf(conn, cred)
    except AppError as e:
        state[AUTH_ERROR] = e
        raise
    return ctx


async def authenticate(
    request: Request,
    _b: HTTPAuthorizationCredentials | None = Depends(_bearer),
    _h: str | None = Depends(_header),
) -> AuthContext:
    """The caller's AuthContext (see `context_of`). A middleware that needed it first (the
    idempotency check) leaves it on the request, so the key is checked once per request."""
    ctx = request.scope.get("state", {}).get(AUTH_STATE)
    if ctx is None:
        ctx = await context_of(request)
        if ctx is None:
            charge_anonymous(request)
            raise Unauthorized(
                "Send an API key as `Authorization: Bearer rp_...` (or sign in to the portal).",
                code="missing_api_key",
            )
    for hook in _ON_AUTHENTICATED:  # the request's audit entry names its caller
        hook(ctx)
    route = request.scope.get("route")
    await ratelimit.check_async(
        request.scope,
        ratelimit.route_class(request.method, getattr(route, "path_format", request.url.path)),
        key=str(ctx.key_id),
        tenant=str(ctx.tenant_id),
        operator=ctx.tenant_id is None,
    )
    return ctx


AUTH_STATE = "auth_context"


def _tenant_scope(scope: str, *, allow_inactive: bool = False):
    async def dependency(auth: AuthContext = Depends(authenticate)) -> AuthContext:
        # async: a check without I/O, run on the event loop rather than a thread-pool hop
        require_tenant_scope(auth, scope, allow_inactive=allow_inactive)
        return auth

    return dependency


async def _platform(auth: AuthContext = Depends(authenticate)) -> AuthContext:
    require_platform(auth)
    return auth


async def _reader(auth: AuthContext = Depends(authenticate)) -> AuthContext:
    require_reader(auth)
    return auth


tenant_read = _tenant_scope("read")

tenant_read_any_status = _tenant_scope("read", allow_inactive=True)

tenant_write = _tenant_scope("write")

tenant_admin = _tenant_scope("admin")

platform = _platform

reader = _reader

# A route's caller, typed: `auth: TenantRead` is `auth: AuthContext = Depends(tenant_read)`.
TenantRead = Annotated[AuthContext, Depends(tenant_read)]

TenantReadAnyStatus = Annotated[AuthContext, Depends(tenant_read_any_status)]

TenantWrite = Annotated[AuthContext, Depends(tenant_write)]

TenantAdmin = Annotated[AuthContext, Depends(tenant_admin)]

Platform = Annotated[AuthContext, Depends(platform)]

# A tenant's reader or an operator: one route for a question both ask, its answer narrowed to
# what the caller's scope sees (tenancy.scoping.restrict).
AnyReader = Annotated[AuthContext, Depends(reader)]
