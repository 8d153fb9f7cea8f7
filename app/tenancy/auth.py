"""API-key authentication and the AuthContext every handler receives."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import event, select
from sqlalchemy.orm import Mapper, Session, object_session
from sqlalchemy.orm.attributes import get_history
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from app.core import redis
from app.core.config import get_settings
from app.core.db import as_aware, session_scope, utcnow
from app.core.errors import AppError, Forbidden, Unauthorized
from app.core.logging import get_logger
from app.core.secrets import server_secret
from app.models.billing import Budget
from app.models.keys import ApiKey
from app.models.sessions import BrowserSession
from app.models.tenants import Tenant
from app.models.workloads import TenantQuota
from app.ratelimit import service as ratelimit

log = get_logger(__name__)

KEY_PREFIX = "rp_"
PREFIX_LEN = 8
SECRET_LEN = 40
_ALPHABET = string.ascii_letters + string.digits

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
    return hmac.new(server_secret("key_pepper"), full_key.encode(), hashlib.sha256).hexdigest()


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
SESSION_PREFIX = "rps_"


def session_hash(token: str) -> str:
    return hmac.new(
        server_secret("key_pepper"), b"session:" + token.encode(), hashlib.sha256
    ).hexdigest()


def csrf_token(token: str) -> str:
    """The session's CSRF token: derived from its secret, so nothing more is stored."""
    return hmac.new(
        server_secret("key_pepper"), b"csrf:" + token.encode(), hashlib.sha256
    ).hexdigest()


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


async def resolve_key(
    raw: str, before_lookup: Callable[[], None] | None = None, address: str | None = None
) -> AuthContext:
    """The AuthContext of an API key: from this process's cache when the key was checked in the
    last `auth_cache_seconds` and none of the rows it is read from has changed since (no I/O),
    else from the database (on a worker thread). Unauthorized when it is not a live key.

    `before_lookup` refuses the lookup when the caller's address has spent its anonymous
    budget (429); a live key's prefix is still looked up then (one client behind a NAT must
    not lock out the others), until `LIVE_LOOKUPS_PER_MINUTE` lookups from `address` behind
    that prefix failed in a minute (a prefix is no secret: guessing secrets behind a known one
    is paced too; a guesser spends the allowance of its guessed prefix only)."""
    prefix = parse_prefix(raw)
    if prefix is None:
        raise Unauthorized("The API key is malformed.", code="invalid_api_key")
    digest = hash_secret(raw)
    epoch = _cache.epoch()
    ctx = _cache.get(digest, epoch)
    if ctx is None:
        past = None  # the allowance a lookup past the spent budget draws on
        if before_lookup is not None:
            try:
                before_lookup()
            except AppError as exc:
                past = f"{address or ''} {prefix}"
                if (
                    exc.status != 429
                    or not await _live_prefix(prefix, epoch)
                    or not _past_budget.allows(past)
                ):
                    raise
        try:
            ctx, expires_at = await run_in_threadpool(_lookup, prefix, digest)
        except Unauthorized:
            if past is not None:
                _past_budget.spend(past)
            raise
        _cache.put(digest, epoch, ctx, expires_at)
    return ctx


LIVE_LOOKUPS_PER_MINUTE = 20


class _Window:
    """At most `limit` failures per key (an address and the prefix tried behind it) in any
    `seconds`, in this process; at most `keys` keys kept (the oldest forgotten first)."""

    def __init__(self, limit: int, seconds: float, keys: int = 10_000) -> None:
        self.limit, self.seconds, self.keys = limit, seconds, keys
        self.seen: OrderedDict[str, deque[float]] = OrderedDict()
        self.lock = threading.Lock()

    def _recent(self, key: str, now: float) -> deque[float] | None:
        q = self.seen.get(key)
        while q and q[0] <= now - self.seconds:
            q.popleft()
        return q

    def allows(self, key: str) -> bool:
        with self.lock:
            q = self._recent(key, time.monotonic())
            return q is None or len(q) < self.limit

    def spend(self, key: str) -> None:
        now = time.monotonic()
        with self.lock:
            q = self._recent(key, now)
            if q is None:
                q = self.seen[key] = deque()
                while len(self.seen) > self.keys:
                    self.seen.popitem(last=False)
            self.seen.move_to_end(key)
            q.append(now)


_past_budget = _Window(LIVE_LOOKUPS_PER_MINUTE, 60.0)

# The prefixes of the keys not revoked: what an address whose anonymous budget is spent may
# still have looked up (a guessed key's prefix is none of them). Kept per auth-cache epoch
# (a key made or revoked anywhere moves it on); without that cache (no Redis: one process),
# read again after PREFIXES_TTL_S.
PREFIXES_TTL_S = 5.0
_PREFIXES: tuple[int | None, float, frozenset[str]] = (None, float("-inf"), frozenset())


async def _live_prefix(prefix: str, epoch: int | None) -> bool:
    """Whether `prefix` is a live key's (see `_PREFIXES`)."""
    global _PREFIXES
    held, read_at, prefixes = _PREFIXES
    now = time.monotonic()
    stale = (
        held != epoch if epoch is not None else held is not None or now - read_at > PREFIXES_TTL_S
    )
    if stale:
        prefixes = await run_in_threadpool(_read_prefixes)
        _PREFIXES = (epoch, now, prefixes)
    return prefix in prefixes


def _read_prefixes() -> frozenset[str]:
    with session_scope() as session:
        return frozenset(session.scalars(select(ApiKey.prefix).where(ApiKey.revoked_at.is_(None))))


async def resolve_session(
    token: str, before_lookup: Callable[[], None] | None = None
) -> AuthContext:
    """The AuthContext of a browser session's token (the key it was opened with, as that key is
    now), cached as keys are. Unauthorized when the session is unknown, signed out or expired,
    or its key no longer lives."""
    if not token.startswith(SESSION_PREFIX) or len(token) > 100:
        raise Unauthorized("The session is not valid; sign in again.", code="invalid_session")
    digest = "s:" + session_hash(token)
    epoch = _cache.epoch()
    ctx = _cache.get(digest, epoch)
    if ctx is None:
        if before_lookup is not None:
            before_lookup()
        ctx, expires_at = await run_in_threadpool(_session_lookup, digest[2:])
        _cache.put(digest, epoch, ctx, expires_at)
    return ctx


async def cache_lookup(digest: str, load: Callable[[], Any | None]) -> Any | None:
    """What `load` reads (on a worker thread) for a credential's `digest`, cached as API keys
    are (the rows it reads must be watched in `_WATCHED`); a miss (None) is not cached."""
    epoch = _cache.epoch()
    hit = _cache.get(digest, epoch)
    if hit is None:
        hit = await run_in_threadpool(load)
        if hit is not None:
            _cache.put(digest, epoch, hit, None)
    return hit


def _session_lookup(digest: str) -> tuple[AuthContext, datetime | None]:

    with session_scope() as session:
        row = session.execute(
            select(BrowserSession, ApiKey, Tenant)
            .join(ApiKey, ApiKey.id == BrowserSession.key_id)
            .outerjoin(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(BrowserSession.token_hash == digest)
        ).first()
        if row is None:
            raise Unauthorized("The session is not valid; sign in again.", code="invalid_session")
        browser, key, tenant = row
        now = utcnow()
        if browser.revoked_at is not None:
            raise Unauthorized("The session was signed out.", code="session_ended")
        idle = timedelta(seconds=get_settings().session_idle_seconds)
        ends = min(as_aware(browser.last_seen_at) + idle, as_aware(browser.expires_at))
        if ends <= now:
            raise Unauthorized("The session has expired; sign in again.", code="session_expired")
        # Idle time counts from the last use seen to the minute (and the cache's lifetime),
        # without a write on every request.
        if now - as_aware(browser.last_seen_at) > timedelta(seconds=60):
            browser.last_seen_at = now
            ends = min(now + idle, as_aware(browser.expires_at))
        ctx, key_ends = key_context(session, key, tenant, now)
        return ctx, min(ends, key_ends) if key_ends is not None else ends


def _lookup(prefix: str, digest: str) -> tuple[AuthContext, datetime | None]:
    """Check the key against the database: (its AuthContext, when it expires)."""

    with session_scope() as session:
        row = session.execute(
            select(ApiKey, Tenant)
            .outerjoin(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.prefix == prefix)
        ).first()
        key, tenant = (row[0], row[1]) if row is not None else (None, None)
        # Compare even when the prefix is unknown, so timing does not reveal which prefixes
        # exist.
        expected = key.secret_hash if key is not None else "0" * 64
        if not hmac.compare_digest(expected, digest) or key is None:
            raise Unauthorized("The API key is invalid.", code="invalid_api_key")
        return key_context(session, key, tenant, utcnow())


def key_context(
    session: Session, key, tenant, now: datetime
) -> tuple[AuthContext, datetime | None]:
    """A live key's AuthContext and when the key expires. The context carries what the tenant
    may do, read in the same transaction: its status, isolation policy, hard limits and budget
    mark, so a submission needs no query before its insert."""
    if key.revoked_at is not None:
        raise Unauthorized("The API key has been revoked.", code="revoked_api_key")
    expires_at = as_aware(key.expires_at) if key.expires_at is not None else None
    if expires_at is not None and expires_at <= now:
        raise Unauthorized("The API key has expired.", code="expired_api_key")
    # Keep last_used_at fresh to the minute (plus the cache's lifetime) without writing on
    # every request.
    if key.last_used_at is None or now - as_aware(key.last_used_at) > timedelta(seconds=60):
        key.last_used_at = now
    if tenant is None:
        ctx = AuthContext(key.id, key.prefix, None, frozenset(key.scopes))
        return ctx, expires_at
    return tenant_context(session, tenant, key.id, key.prefix, key.scopes), expires_at


def tenant_context(
    session: Session, tenant, key_id: uuid.UUID, key_prefix: str, scopes: Iterable[str]
) -> AuthContext:
    """A context acting for `tenant` with these scopes (a key's, or a controller's acting for
    the tenant: app/endpoints), with what its submissions are checked against."""
    limits = session.execute(
        select(TenantQuota.gpu_model, TenantQuota.limit_milli)
        .where(TenantQuota.tenant_id == tenant.id)
        .order_by(TenantQuota.gpu_model)
    ).all()
    exhausted = session.scalar(select(Budget.exhausted_period).where(Budget.tenant_id == tenant.id))
    policy = tenant.isolation_policy
    return AuthContext(
        key_id,
        key_prefix,
        tenant.id,
        frozenset(scopes),
        tenant.status,
        tuple(policy) if policy is not None else None,
        tuple((m, limit) for m, limit in limits),
        exhausted,
    )


class _AuthCache:
    """Keys this process has checked, by the key's HMAC, each with the epoch it was read
    under. A committed change that matters to any context (a key, a tenant, a quota, a budget's
    exhausted mark: `_WATCHED` below, through the ORM) is published on a Redis channel; each
    API process listens on it from a thread and, on every message, clears its entries and
    moves its local epoch on. So a request costs no I/O to know whether it may trust the cache.

    An entry keeps the epoch read before the database, so a change published after that read
    always leaves it behind. The listener also moves the epoch on whenever it (re)subscribes,
    since messages sent while it was away are lost; while it is not subscribed (no Redis,
    Redis failing) nothing is cached or trusted and every request reads the database. A change
    reaches the other processes within the time its message takes to arrive (well under a
    millisecond on one host); the entries' TTL bounds what a lost message could leave."""

    MAX_ENTRIES = 10_000
    RETRY_S = 1.0

    def __init__(self) -> None:
        # AuthContexts, and what `cache_lookup` keeps (a node agent's NodeCaller).
        self.entries: dict[str, tuple[float, int, Any, datetime | None]] = {}
        self.local = 0  # moved on by every message and every (re)subscription
        self.live = False  # subscribed: the local epoch can be trusted
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    @staticmethod
    def channel() -> str:
        return f"{get_settings().broker_key_prefix}rackplane:auth-changed"

    def epoch(self) -> int | None:
        s = get_settings()
        if s.auth_cache_seconds <= 0 or not s.redis_url:
            return None
        if self.thread is None or not self.thread.is_alive():  # first use, or after a fork
            with self.lock:
                if self.thread is None or not self.thread.is_alive():
                    self.live = False
                    self.thread = threading.Thread(
                        target=self._listen, args=(s.redis_url,), daemon=True, name="auth-epoch"
                    )
                    self.thread.start()
        return self.local if self.live else None

    def _invalidate(self) -> None:
        self.local += 1
        self.entries.clear()

    def _listen(self, url: str) -> None:
        def on_message(msg: dict) -> None:
            self._invalidate()
            if msg["type"] == "subscribe":
                self.live = True

        def on_down(exc: Exception) -> None:
            self.live = False
            self._invalidate()
            log.warning("auth_epoch_listener_down", error=str(exc)[:300])

        redis.follow(url, lambda p: p.subscribe(self.channel()), on_message, on_down, self.RETRY_S)

    def get(self, digest: str, epoch: int | None) -> Any | None:
        hit = self.entries.get(digest) if epoch is not None else None
        if hit is None:
            return None
        deadline, at_epoch, ctx, expires_at = hit
        if (
            at_epoch != epoch
            or not self.live
            or time.monotonic() >= deadline
            or (expires_at is not None and expires_at <= utcnow())
        ):
            self.entries.pop(digest, None)
            return None
        return ctx

    def put(self, digest: str, epoch: int | None, ctx: Any, expires_at: datetime | None) -> None:
        if epoch is None or epoch != self.local:  # a change arrived while the key was read
            return
        if len(self.entries) >= self.MAX_ENTRIES:
            self.entries.clear()
        ttl = get_settings().auth_cache_seconds
        self.entries[digest] = (time.monotonic() + ttl, epoch, ctx, expires_at)

    def bump(self) -> None:
        """Something an AuthContext is read from changed (committed): no process may trust
        what it has cached."""
        self._invalidate()
        client = redis.client()
        if client is None:
            return
        try:
            client.publish(self.channel(), b"1")
        except Exception as exc:  # the other processes' entries still end with their TTL
            redis.trip()
            log.warning("auth_epoch_publish_failed", error=str(exc)[:300])


_cache = _AuthCache()
_CHANGED = "rackplane_auth_changed"
# The rows an AuthContext is read from, and which of their columns' changes matter to it.
_WATCHED: dict[str, Callable[[set[str]], bool]] = {
    "ApiKey": lambda cols: bool(cols - {"last_used_at"}),
    "Tenant": lambda cols: bool(cols - {"stripe_customer_id"}),
    "TenantQuota": lambda cols: True,
    "Budget": lambda cols: "exhausted_period" in cols,
    "BrowserSession": lambda cols: bool(cols - {"last_seen_at"}),
    # A node agent's credential (app/tenancy/nodes.py): revoked, rotated.
    "NodeCredential": lambda cols: True,
}


def _watched(mapper: Mapper) -> Callable[[set[str]], bool] | None:
    cls = mapper.class_
    return _WATCHED.get(cls.__name__) if cls.__module__.startswith("app.") else None


def _changed(target) -> None:
    session = object_session(target)
    if session is not None:
        session.info[_CHANGED] = True


@event.listens_for(Mapper, "after_update")
def _row_updated(mapper: Mapper, _connection, target) -> None:
    matters = _watched(mapper)
    if matters is not None and matters(
        {a.key for a in mapper.column_attrs if get_history(target, a.key).has_changes()}
    ):
        _changed(target)


@event.listens_for(Mapper, "after_insert")
def _row_inserted(mapper: Mapper, _connection, target) -> None:
    # A new tenant is in no one's cache; a new quota or budget changes a cached tenant; a new
    # key changes the live prefixes (`_live_prefix`; keys are made rarely).
    if (
        mapper.class_.__name__ in ("TenantQuota", "Budget", "ApiKey")
        and _watched(mapper) is not None
    ):
        _changed(target)


@event.listens_for(Mapper, "after_delete")
def _row_deleted(mapper: Mapper, _connection, target) -> None:
    if _watched(mapper) is not None:
        _changed(target)


@event.listens_for(Session, "do_orm_execute")
def _bulk_statement(state) -> None:
    if (state.is_update or state.is_delete) and any(
        _watched(m) is not None for m in state.all_mappers
    ):
        state.session.info[_CHANGED] = True


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    global _PREFIXES
    if session.info.pop(_CHANGED, None):
        _cache.bump()
        _PREFIXES = (None, float("-inf"), frozenset())  # this process reads them again


@event.listens_for(Session, "after_rollback")
def _rolled_back(session: Session) -> None:
    session.info.pop(_CHANGED, None)


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


def require_platform(auth: AuthContext) -> None:
    if not auth.is_platform:
        raise Forbidden(
            "This is for operators; it needs a key with the `platform` scope.",
            code="platform_scope_required",
        )


def _tenant_scope(scope: str, *, allow_inactive: bool = False):
    async def dependency(auth: AuthContext = Depends(authenticate)) -> AuthContext:
        # async: a check without I/O, run on the event loop rather than a thread-pool hop
        require_tenant_scope(auth, scope, allow_inactive=allow_inactive)
        return auth

    return dependency


async def _platform(auth: AuthContext = Depends(authenticate)) -> AuthContext:
    require_platform(auth)
    return auth


tenant_read = _tenant_scope("read")
tenant_read_any_status = _tenant_scope("read", allow_inactive=True)
tenant_write = _tenant_scope("write")
tenant_admin = _tenant_scope("admin")
platform = _platform

# A route's caller, typed: `auth: TenantRead` is `auth: AuthContext = Depends(tenant_read)`.
TenantRead = Annotated[AuthContext, Depends(tenant_read)]
TenantReadAnyStatus = Annotated[AuthContext, Depends(tenant_read_any_status)]
TenantWrite = Annotated[AuthContext, Depends(tenant_write)]
TenantAdmin = Annotated[AuthContext, Depends(tenant_admin)]
Platform = Annotated[AuthContext, Depends(platform)]
