"""The process's Redis client for small, latency-sensitive calls (kicks, the auth epoch), with
a breaker: after a failure, callers skip Redis for a moment instead of each waiting out a
timeout. None without Redis (the embedded default). Code on an event loop (the API's request
path) awaits an asyncio client instead (`async_client`): a blocking call there holds every other
request of the process for its round trip."""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from app.core.config import get_settings

SENTINEL = "redis+sentinel://"
BREAKER_SECONDS = 2.0
TIMEOUT_S = 0.5
_state: dict[str, Any] = {"client": None, "url": None, "open_until": 0.0}


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int, str | None] | None:
    """`redis+sentinel://[:password@]host:port,host:port,.../master[/db]` as (the Sentinels,
    the master's name, its db, its password); None for any other URL. One setting
    (`REDIS_URL`) names Redis either way: the client (`connect`), Celery's broker
    (`Settings.broker_url`) and the pub/sub listeners all follow the master Sentinel names."""
    if not url.startswith(SENTINEL):
        return None
    rest = url[len(SENTINEL) :]
    password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        password = auth.split(":", 1)[1] if ":" in auth else auth
        password = password or None
    hosts, _, path = rest.partition("/")
    master, _, db = path.partition("/")
    if not hosts or not master:
        raise ValueError(f"{url!r}: expected {SENTINEL}host:port[,host:port...]/master[/db]")
    sentinels = []
    for h in hosts.split(","):
        host, _, port = h.rpartition(":")
        sentinels.append((host or h, int(port) if port.isdigit() else 26379))
    return sentinels, master, int(db or 0), password


def connect(url: str, *, asynchronous: bool = False, **kwargs: Any) -> Any:
    """A client for `url`: a plain Redis URL, or the master a set of Sentinels names (it asks
    them again after a failover, on its next connection)."""
    parts = sentinel_parts(url)
    if asynchronous:
        import redis.asyncio as lib
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        sentinel_cls: Any = AsyncSentinel
    else:
        import redis as lib
        from redis.sentinel import Sentinel as SyncSentinel

        sentinel_cls = SyncSentinel
    if parts is None:
        return lib.Redis.from_url(url, **kwargs)
    hosts, master, db, password = parts
    timeouts = {
        k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")
    }
    sentinel = sentinel_cls(hosts, sentinel_kwargs=timeouts or {"socket_timeout": TIMEOUT_S})
    return sentinel.master_for(master, db=db, password=password, **kwargs)


def client():
    """The shared client, or None when there is no Redis or the breaker is open."""
    url = get_settings().redis_url
    if not url or time.monotonic() < _state["open_until"]:
        return None
    if _state["client"] is None or _state["url"] != url:
        _state["client"] = connect(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
        _state["url"] = url
    return _state["client"]


# One asyncio client per event loop: its connections belong to the loop that opened them (the
# API has one loop per process; tests open one per TestClient).
_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def async_client():
    """The running loop's asyncio client, or None when there is no Redis or the breaker (shared
    with `client`) is open."""
    url = get_settings().redis_url
    if not url or time.monotonic() < _state["open_until"]:
        return None
    loop = asyncio.get_running_loop()
    hit = _loops.get(loop)
    if hit is None or hit[0] != url:
        hit = _loops[loop] = (
            url,
            connect(
                url, asynchronous=True, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S
            ),
        )
    return hit[1]


def trip() -> None:
    """A call failed: leave Redis alone for BREAKER_SECONDS."""
    _state["open_until"] = time.monotonic() + BREAKER_SECONDS


def follow(
    url: str,
    subscribe: Any,
    on_message: Any,
    on_down: Any,
    retry_s: float,
) -> None:
    """A listener thread's loop, for ever: connect, `subscribe(pubsub)`, hand every message to
    `on_message(msg)`; on any failure `on_down(exc)`, wait `retry_s`, and connect again."""
    while True:
        try:
            client = connect(
                url,
                socket_connect_timeout=TIMEOUT_S,
                socket_keepalive=True,
                health_check_interval=10,
            )
            pubsub = client.pubsub()
            subscribe(pubsub)
            while True:
                msg = pubsub.get_message(timeout=1.0)
                if msg is not None:
                    on_message(msg)
        except Exception as exc:
            on_down(exc)
            time.sleep(retry_s)
