"""Rate limits: token buckets per API key and per tenant, by route class.

- **Classes**: `read` (GET), `write` (POST, PUT, PATCH, DELETE), `expensive` (reads that scan
  a month of the ledger: billing exports, reconciliation, usage; a GraphQL operation pays one
  token per such field it asks for, aliases included), `signup` and `signin` (per client
  address, before any key is known: a portal sign-in is a guess at a key until it succeeds),
  and `anonymous` (per client address: every request without a credential and every failed
  authentication; once it is spent, a key this process has not seen lately is not even looked
  up, so guessing keys costs the database nothing). A node agent's requests (by node
  credential, `app/tenancy/nodes.py`) are of class `node` whatever their route: one bucket per
  node, `agent_rate_limit` a second with bursts of `agent_rate_burst` (0: none).
- **Buckets**: a request takes one token from its key's bucket and one from its tenant's
  (several keys of one tenant share the tenant's), atomically, or from neither. Operators have
  buckets of their own, `operator_factor` times a tenant key's (0: exempt).
- **Where**: one Lua script in Redis, so every API process draws from the same buckets; in the
  process on the embedded default (one API process, no Redis). If Redis is unreachable the
  request is let through and the failure logged: a limiter must not take the API down.
- **Answer**: 429 problem+json `rate_limited` with `Retry-After`; every limited response
  carries `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` (seconds until the
  bucket is full again), as the IETF draft names them.

Checked after authentication (a forged key cannot drain its prefix's bucket), in the route's
`authenticate` dependency, so a refused request costs no body parsing and no database work.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from functools import lru_cache
from typing import Any

from redis.exceptions import NoScriptError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core import redis
from app.core.config import get_settings
from app.core.errors import AppError
from app.core.limits import Limit, parse
from app.core.logging import get_logger

log = get_logger(__name__)
EXPENSIVE = frozenset(
    {
        "/v1/billing/exports",
        "/v1/admin/billing/exports",
        "/v1/admin/billing/reconciliation",
        "/v1/usage",
        "/v1/admin/usage",
        "/v1/admin/utilisation",
    }
)
HEADERS_STATE = "ratelimit_headers"
NODE = "node"  # a node agent's requests: one bucket per node, whatever the route


class RateLimited(AppError):
    status, code, title = 429, "rate_limited", "Too many requests"


@lru_cache
def _limits(spec: str) -> dict[str, Limit]:
    return parse(spec)


def route_class(method: str, template: str) -> str:
    if method in ("GET", "HEAD"):
        return "expensive" if template in EXPENSIVE else "read"
    return "write"


# KEYS: the buckets. ARGV: now, cost, then capacity and rate per bucket. Takes `cost` tokens
# from every bucket or from none (a cost of 0 only asks whether a token is there). Returns
# {allowed, remaining (tokens left in the tightest bucket, floor), wait (s until the tightest
# has what was asked), full (s until it is full), its capacity}.
_SCRIPT = """
local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local need = math.max(cost, 1)
local n = #KEYS
local tokens, caps, rates = {}, {}, {}
local allowed = 1
for i = 1, n do
  local cap, rate = tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
  local b = redis.call('HMGET', KEYS[i], 't', 'at')
  local t, at = tonumber(b[1]), tonumber(b[2])
  if t == nil then t, at = cap, now end
  t = math.min(cap, t + math.max(0, now - at) * rate)
  tokens[i], caps[i], rates[i] = t, cap, rate
  if t < need then allowed = 0 end
end
local tight, tight_left = 1, nil
for i = 1, n do
  if allowed == 1 then tokens[i] = tokens[i] - cost end
  redis.call('HSET', KEYS[i], 't', tostring(tokens[i]), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((caps[i] / rates[i]) * 1000) + 1000)
  if tight_left == nil or tokens[i] / caps[i] < tight_left then
    tight, tight_left = i, tokens[i] / caps[i]
  end
end
local t, cap, rate = tokens[tight], caps[tight], rates[tight]
local wait = 0
if t < need then wait = (need - t) / rate end
return {allowed, tostring(math.floor(t)), tostring(wait), tostring((cap - t) / rate), tostring(cap)}
"""


class _Local:
    """The same buckets in this process (embedded default)."""

    def __init__(self) -> None:
        self.buckets: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()

    def take(self, keys: list[str], limits: list[Limit], now: float, cost: int = 1) -> tuple:
        need = max(cost, 1)
        with self.lock:
            state = []
            for k, lim in zip(keys, limits, strict=True):
                t, at = self.buckets.get(k, (lim.capacity, now))
                state.append(min(lim.capacity, t + max(0.0, now - at) * lim.rate))
            allowed = all(t >= need for t in state)
            if allowed:
                state = [t - cost for t in state]
            for k, t in zip(keys, state, strict=True):
                self.buckets[k] = (t, now)
            i = min(range(len(keys)), key=lambda j: state[j] / limits[j].capacity)
            t, lim = state[i], limits[i]
            wait = (need - t) / lim.rate if t < need else 0.0
            return allowed, math.floor(t), wait, (lim.capacity - t) / lim.rate, lim.capacity


_local = _Local()
_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()


def _args(limits: list[Limit], now: float, cost: int) -> list[float]:
    args: list[float] = [now, cost]
    for lim in limits:
        args += [lim.capacity, lim.rate]
    return args


def _taken(reply: list) -> tuple:
    allowed, left, wait, full, cap = reply
    return bool(allowed), int(left), float(wait), float(full), float(cap)


def _redis_take(client, keys: list[str], limits: list[Limit], now: float, cost: int) -> tuple:
    args = _args(limits, now, cost)
    try:
        return _taken(client.evalsha(_SHA, len(keys), *keys, *args))
    except NoScriptError:  # a restarted Redis: EVAL caches it again
        return _taken(client.eval(_SCRIPT, len(keys), *keys, *args))


async def _redis_take_async(
    client, keys: list[str], limits: list[Limit], now: float, cost: int
) -> tuple:
    args = _args(limits, now, cost)
    try:
        return _taken(await client.evalsha(_SHA, len(keys), *keys, *args))
    except NoScriptError:
        return _taken(await client.eval(_SCRIPT, len(keys), *keys, *args))


def _buckets(cls: str, *, key: str | None, tenant: str | None, operator: bool, address: str | None):
    s = get_settings()
    prefix = f"{s.broker_key_prefix}rackplane:rl:{cls}:"
    if cls == NODE:
        if s.agent_rate_limit <= 0:
            return [], []
        return [f"{prefix}{key}"], [Limit(capacity=s.agent_rate_burst, rate=s.agent_rate_limit)]
    base = _limits(s.rate_limits).get(cls)
    if base is None:
        return [], []
    if cls in ("signup", "signin", "anonymous"):
        return [f"{prefix}addr:{address}"], [base]
    if operator:
        if s.rate_limit_operator_factor <= 0:
            return [], []  # exempt
        return [f"{prefix}op:{key}"], [base.scaled(s.rate_limit_operator_factor)]
    return (
        [f"{prefix}key:{key}", f"{prefix}tenant:{tenant}"],
        [base, base.scaled(s.rate_limit_tenant_factor)],
    )


def check(
    scope: Scope,
    cls: str,
    *,
    key: str | None = None,
    tenant: str | None = None,
    operator: bool = False,
    address: str | None = None,
    cost: int = 1,
) -> None:
    """Take `cost` tokens for this request (0: only check that one is left), or raise
    RateLimited. Leaves the RateLimit-* headers for the response in the request's state.
    Blocks on Redis: on an event loop, await `check_async` instead."""
    keys, limits = _buckets(cls, key=key, tenant=tenant, operator=operator, address=address)
    if not keys:
        return
    now = time.time()
    client = redis.client() if get_settings().redis_url else None
    try:
        if client is not None:
            taken = _redis_take(client, keys, limits, now, cost)
        elif get_settings().redis_url:  # Redis configured but its breaker is open
            return
        else:
            taken = _local.take(keys, limits, now, cost)
    except Exception as exc:  # fail open: the limiter must not take the API down
        _unavailable(exc)
        return
    _answer(scope, cls, cost, taken)


async def check_async(
    scope: Scope,
    cls: str,
    *,
    key: str | None = None,
    tenant: str | None = None,
    operator: bool = False,
    address: str | None = None,
    cost: int = 1,
) -> None:
    """`check` for the event loop: the Redis round trip is awaited, so the process's other
    requests go on meanwhile. Called inline, it held the API's loop for the round trip on every
    request (a quarter of the loop's time at 100 submissions/s, profiled with py-spy)."""
    keys, limits = _buckets(cls, key=key, tenant=tenant, operator=operator, address=address)
    if not keys:
        return
    now = time.time()
    if not get_settings().redis_url:  # the embedded default: buckets in the process, no I/O
        _answer(scope, cls, cost, _local.take(keys, limits, now, cost))
        return
    client = redis.async_client()
    if client is None:  # the breaker is open
        return
    try:
        taken = await _redis_take_async(client, keys, limits, now, cost)
    except Exception as exc:  # fail open: the limiter must not take the API down
        _unavailable(exc)
        return
    _answer(scope, cls, cost, taken)


def _unavailable(exc: Exception) -> None:
    redis.trip()
    log.warning("rate_limit_unavailable", error=str(exc)[:300])


def _answer(scope: Scope, cls: str, cost: int, taken: tuple) -> None:
    """Leave the RateLimit-* headers in the request's state; raise RateLimited if refused."""
    allowed, left, wait, full, cap = taken
    headers = {
        "RateLimit-Limit": str(int(cap)),
        "RateLimit-Remaining": str(max(0, left)),
        "RateLimit-Reset": str(math.ceil(full)),
    }
    scope.setdefault("state", {})[HEADERS_STATE] = headers
    if not allowed:
        if cost > cap:
            raise RateLimited(
                f"This request costs {cost} {cls} tokens and the bucket holds {int(cap)}: ask "
                "for fewer of them per request.",
                code="request_too_costly",
                limit_class=cls,
                cost=cost,
                capacity=int(cap),
                headers=headers,
            )
        retry = max(1, math.ceil(wait))
        raise RateLimited(
            f"Too many {cls} requests; retry in {retry} s.",
            limit_class=cls,
            headers={**headers, "Retry-After": str(retry)},
        )


def client_address(conn: Any) -> str:
    """The caller's address, as the `signup`, `signin` and `anonymous` buckets know it."""
    client = getattr(conn, "client", None)
    return client.host if client else "unknown"


class RateLimitHeadersMiddleware:
    """Adds the RateLimit-* headers a request's check left to its response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = scope.get("state", {}).get(HEADERS_STATE)
                if extra:
                    have = {k.lower() for k, _ in message.get("headers", [])}
                    message["headers"] = [
                        *message.get("headers", []),
                        *(
                            (k.lower().encode(), v.encode())
                            for k, v in extra.items()
                            if k.lower().encode() not in have
                        ),
                    ]
            await send(message)

        await self.app(scope, receive, with_headers)
