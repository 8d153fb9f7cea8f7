"""From a credential to its AuthContext: the database lookup of a key or a session, and the
per-process cache of what was looked up, cleared when a row it was read from changes (SQLAlchemy
listeners, published on Redis to every API process)."""

from __future__ import annotations

import hmac
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Mapper, Session, object_session
from sqlalchemy.orm.attributes import get_history
from starlette.concurrency import run_in_threadpool

from app.core import redis
from app.core.config import get_settings
from app.core.db import as_aware, session_scope, utcnow
from app.core.errors import AppError, Unauthorized
from app.core.logging import get_logger
from app.models.billing import Budget
from app.models.keys import ApiKey
from app.models.sessions import BrowserSession
from app.models.tenants import Tenant
from app.models.workloads import TenantQuota
from app.tenancy.credentials import SESSION_PREFIX, hash_secret, parse_prefix, session_hash
from app.tenancy.principal import AuthContext

log = get_logger(__name__)


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
