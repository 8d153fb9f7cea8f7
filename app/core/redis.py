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

BREAKER_SECONDS = 2.0
TIMEOUT_S = 0.5
_state: dict[str, Any] = {"client": None, "url": None, "open_until": 0.0}


def client():
    """The shared client, or None when there is no Redis or the breaker is open."""
    url = get_settings().redis_url
    if not url or time.monotonic() < _state["open_until"]:
        return None
    if _state["client"] is None or _state["url"] != url:
        import redis

        _state["client"] = redis.Redis.from_url(
            url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S
        )
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
        import redis.asyncio

        hit = _loops[loop] = (
            url,
            redis.asyncio.Redis.from_url(
                url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S
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
    import redis as redis_lib

    while True:
        try:
            client = redis_lib.Redis.from_url(
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
