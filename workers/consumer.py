"""The worker's broker consumer, reconnecting quickly through a failover.

Celery's consumer reconnects with kombu's defaults: 2 s, then 4, 6, ... up to 30 s between
attempts. Through a Redis master's loss that is what placement waited for: the Sentinels named
the new master 2.2 s after the kill, the consumer's second attempt came at 2 s (no master yet)
and its third at 6 s, and placement resumed 7.2 s after the kill (BENCHMARKS §16). Here the
consumer tries again after 0.2 s, then 0.3 s longer each time, at most 1 s apart: it follows a
promotion within a second of the Sentinels naming it, at the cost of about one connection
attempt (to the Sentinels) a second while none is named."""

from __future__ import annotations

import functools

from celery.worker.consumer import Consumer

RECONNECT = {"interval_start": 0.2, "interval_step": 0.3, "interval_max": 1.0}


class FailoverConsumer(Consumer):
    def ensure_connected(self, conn):
        # Celery's own retry loop and error handling, with these intervals (an attribute of
        # this connection object only).
        conn.ensure_connection = functools.partial(conn.ensure_connection, **RECONNECT)
        return super().ensure_connected(conn)
