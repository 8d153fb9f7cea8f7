"""One beat fires each schedule, however many run: a lease in Redis.

Every worker started with `--beat` (and `rackplane worker`, `rackplane up`) runs a beat; with
two or more (high availability), each schedule would fire once per beat. `LeasedScheduler`
sends due tasks only while it holds the lease `<broker prefix>beat-lease:<name>` (a key
set with NX and a time to live, renewed by its holder each tick, taken over by another beat
once its holder stops renewing it: killed, hung, cut off). The embedded default (no Redis)
runs one process and needs no lease.

What a takeover costs: the new holder's own schedule file says when it last sent each task,
so tasks due meanwhile are sent at once; every scheduled task is idempotent (a sweep, a tick,
a drain), so a task sent twice around a takeover costs a repeat, never a wrong state.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from celery.beat import PersistentScheduler

from app.core.config import get_settings
from app.core.logging import get_logger
from app.core.redis import connect

log = get_logger(__name__)
TTL_S = 15.0  # a holder that has not renewed in this long has lost it
RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class Lease:
    """A named lease in Redis: `hold()` takes it when free, renews it when ours."""

    def __init__(self, url: str, key: str, ttl_s: float = TTL_S):
        self.key, self.ttl_ms = key, int(ttl_s * 1000)
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        self.held = False

    def hold(self) -> bool:
        try:
            ours = bool(self.client.eval(RENEW, 1, self.key, self.me, self.ttl_ms))
            if not ours:
                ours = bool(self.client.set(self.key, self.me, nx=True, px=self.ttl_ms))
        except Exception as exc:  # Redis away: nobody can send tasks anyway
            log.warning("beat_lease_unreachable", key=self.key, error=str(exc))
            ours = False
        if ours != self.held:
            log.info("beat_lease_" + ("taken" if ours else "lost"), key=self.key, holder=self.me)
        self.held = ours
        return ours

    def release(self) -> None:
        try:
            if self.client.get(self.key) == self.me.encode():
                self.client.delete(self.key)
        except Exception:
            pass
        self.held = False


def lease_key() -> str:
    s = get_settings()
    return f"{s.broker_key_prefix}beat-lease:{s.beat_lease}"


class LeasedScheduler(PersistentScheduler):
    """Celery's persistent scheduler, sending only while it holds the beat lease."""

    def __init__(self, *args: Any, **kwargs: Any):
        url = get_settings().redis_url
        self.lease = Lease(url, lease_key()) if url else None
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self.lease is not None and not self.lease.hold():
            return TTL_S / 3  # look again well before a holder's lease could run out
        return min(super().tick(*args, **kwargs), TTL_S / 3)

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()  # a clean stop hands over at once
        super().close()
