"""Wake-ups after commits: "the log under `topic` has new rows", from whichever process wrote
them to whichever is waiting for them (GraphQL subscriptions).

A writer marks the topics its transaction touches (`mark`); once the transaction commits, and
never before nor after a rollback, the topics are published. A message says only that there is
something new to read: the rows themselves are read from the database, which stays the one
source of truth, so a lost, late or spurious message costs a reader a poll interval or a
needless read, never an event (a savepoint rolled back after a mark publishes a spurious one).

Across processes (API and workers) the messages go through Redis pub/sub on
`<broker prefix>rackplane:feed:<topic>`: each process sends from one background thread (a
commit costs a queue put, not a round trip; a burst of commits coalesces), and each API process
listens from one background thread, forwarding to its local waiters. Without Redis (the
embedded default) a commit wakes the waiters of its own process directly (the API's own
writes, and everything with `RACKPLANE_CELERY_EAGER`); the worker process's commits are seen
by a watcher of SQLite's `data_version` (it changes when another connection commits), polled
every `SqliteWatcher.INTERVAL_S` while anyone waits, which wakes every waiter. PostgreSQL
without Redis has neither: its readers rely on their poll. A waiter is an `asyncio.Event` woken
thread-safely on its own event loop.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from app.core import redis
from app.core.config import get_settings
from app.core.logging import get_logger

log = get_logger(__name__)
_PENDING = "rackplane_feed_pending"
RETRY_S = 1.0


def mark(session: Session, *topics: str) -> None:
    """Publish `topics` once the session's transaction commits."""
    session.info.setdefault(_PENDING, set()).update(topics)


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    topics = session.info.pop(_PENDING, None)
    if topics:
        publish(topics)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)


def publish(topics: Iterable[str]) -> None:
    """Tell every process's waiters on `topics` to read again (Redis), or this process's."""
    topics = set(topics)
    if get_settings().redis_url:
        _sender().put(topics)
    else:
        hub.notify(topics)


def channel_prefix() -> str:
    return f"{get_settings().broker_key_prefix}rackplane:feed:"


# --- waiters in this process ------------------------------------------------------------------


class Waiter:
    """One reader's wake-up: set (from any thread) when a topic it matches is published."""

    def __init__(self, matches: Callable[[str], bool]):
        self.topic: str | None = None
        self.matches = matches
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        # When it was last woken (monotonic): after the commits that woke it, so a read that
        # starts later sees them; waiters woken together share one read of the log's tail.
        self.woken_at = 0.0

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, timeout: float) -> bool:
        """True when woken, False when `timeout` passed first."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def wake(self) -> None:
        self.woken_at = max(self.woken_at, time.monotonic())
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # its loop is closed: the hub forgets it on unregister
            pass


class TopicCache:
    """Answers read from the database under a topic, each kept until that topic is published
    (or `ttl_s` passed): a reader that finds one trusts it without a read. Trusted only while
    this process hears every message (the Redis listener is subscribed); otherwise, as when it
    (re)subscribes, everything cached is dropped and every reader reads the database.

    `begin(topic)` before the read and `put(topic, token, value)` after it: an answer whose
    topic was published in between is not kept, since it may predate the change."""

    MAX_ENTRIES = 100_000

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, Any]] = {}
        self._dropped: dict[str, int] = {}  # topic -> how often it was published
        self._cleared = 0  # how often everything was dropped
        self._lock = threading.Lock()
        hub.caches.append(self)

    @staticmethod
    def trusted() -> bool:
        return bool(get_settings().redis_url) and _listener.live

    def get(self, topic: str) -> Any | None:
        if not self.trusted():
            return None
        hit = self._entries.get(topic)
        if hit is None or time.monotonic() >= hit[0]:
            return None
        return hit[1]

    def begin(self, topic: str) -> tuple[int, int] | None:
        if not self.trusted():
            return None
        with self._lock:
            return self._cleared, self._dropped.get(topic, 0)

    def put(self, topic: str, token: tuple[int, int] | None, value: Any) -> None:
        with self._lock:
            if token is None or token != (self._cleared, self._dropped.get(topic, 0)):
                return
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
            self._entries[topic] = (time.monotonic() + self.ttl_s, value)

    def drop(self, topics: Iterable[str]) -> None:
        with self._lock:
            for t in topics:
                self._dropped[t] = self._dropped.get(t, 0) + 1
                self._entries.pop(t, None)

    def clear(self) -> None:
        with self._lock:
            self._cleared += 1
            self._entries.clear()


class Hub:
    def __init__(self) -> None:
        self._waiters: set[Waiter] = set()
        # Waiters of one exact topic (a node agent's), found without asking every waiter.
        self._by_topic: dict[str, set[Waiter]] = {}
        self._lock = threading.Lock()
        # Dropped before any waiter wakes: a woken reader never finds what its wake-up replaced.
        self.caches: list[TopicCache] = []
        # The server is stopping: long polls answer what they have now rather than wait (and
        # be cancelled by the server's shutdown, an error where an answer was due).
        self.closing = False

    def register(self, matches: Callable[[str], bool]) -> Waiter:
        w = Waiter(matches)
        with self._lock:
            self._waiters.add(w)
        self._listen()
        return w

    def register_topic(self, topic: str) -> Waiter:
        """A waiter woken by `topic` alone; unregister it as any other."""
        w = Waiter(topic.__eq__)
        w.topic = topic
        with self._lock:
            self._by_topic.setdefault(topic, set()).add(w)
        self._listen()
        return w

    def _listen(self) -> None:
        s = get_settings()
        if s.redis_url:
            _listener.ensure()
        elif s.is_sqlite:
            _watcher.ensure(s.sqlalchemy_url.split("///", 1)[-1])

    def unregister(self, w: Waiter) -> None:
        with self._lock:
            self._waiters.discard(w)
            if w.topic is not None:
                same = self._by_topic.get(w.topic)
                if same is not None:
                    same.discard(w)
                    if not same:
                        del self._by_topic[w.topic]

    def notify(self, topics: Iterable[str]) -> None:
        topics = list(topics)
        for c in self.caches:
            c.drop(topics)
        with self._lock:
            waiters = list(self._waiters)
            exact = [w for t in topics for w in self._by_topic.get(t, ())]
        for w in exact:
            w.wake()
        for w in waiters:
            if any(w.matches(t) for t in topics):
                w.wake()

    def notify_all(self) -> None:
        for c in self.caches:
            c.clear()
        with self._lock:
            waiters = list(self._waiters)
            waiters += [w for same in self._by_topic.values() for w in same]
        for w in waiters:
            w.wake()

    def shut(self) -> None:
        """The server is stopping: every waiter wakes, and waits no more."""
        self.closing = True
        self.notify_all()

    def __len__(self) -> int:
        return len(self._waiters) + sum(len(same) for same in self._by_topic.values())


hub = Hub()


# --- Redis: one sender and one listener thread per process -------------------------------------


class _Sender:
    """Publishes queued topics from a thread, coalescing what queued up meanwhile."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[set[str]] = queue.SimpleQueue()
        self.pid = os.getpid()
        threading.Thread(target=self._run, daemon=True, name="feed-sender").start()

    def put(self, topics: set[str]) -> None:
        self.q.put(topics)

    def _run(self) -> None:
        while True:
            topics = set(self.q.get())
            while True:
                try:
                    topics |= self.q.get_nowait()
                except queue.Empty:
                    break
            self.send(topics)

    @staticmethod
    def send(topics: set[str]) -> None:
        client = redis.client()
        try:
            if client is None:
                raise ConnectionError("redis breaker open")
            prefix = channel_prefix()
            pipe = client.pipeline(transaction=False)
            for t in sorted(topics):
                pipe.publish(prefix + t, b"")
            pipe.execute()
        except Exception as exc:
            if client is not None:
                redis.trip()
            # Other processes' readers find the rows on their next poll; this one's now.
            hub.notify(topics)
            log.warning("feed_publish_failed", topics=sorted(topics)[:10], error=str(exc)[:300])


_senders: dict[str, _Sender] = {}
_senders_lock = threading.Lock()


def _sender() -> _Sender:
    s = _senders.get("s")
    if s is None or s.pid != os.getpid():  # first use, or a forked child (threads don't fork)
        with _senders_lock:
            s = _senders.get("s")
            if s is None or s.pid != os.getpid():
                s = _senders["s"] = _Sender()
    return s


class _Listener:
    """Forwards the feed's Redis messages to this process's waiters. Whenever it (re)subscribes
    it wakes every waiter, since messages sent while it was away are lost."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.lock = threading.Lock()
        self.live = False

    def ensure(self) -> None:
        if self.thread is not None and self.thread.is_alive() and self.pid == os.getpid():
            return
        with self.lock:
            if self.thread is None or not self.thread.is_alive() or self.pid != os.getpid():
                self.pid = os.getpid()
                self.thread = threading.Thread(
                    target=self._run,
                    args=(get_settings().redis_url, channel_prefix()),
                    daemon=True,
                    name="feed-listener",
                )
                self.thread.start()

    def _run(self, url: str, prefix: str) -> None:
        def on_message(msg: Any) -> None:
            if msg["type"] == "psubscribe":
                self.live = True
                hub.notify_all()
            elif msg["type"] == "pmessage":
                ch = msg["channel"]
                ch = ch.decode() if isinstance(ch, bytes) else ch
                hub.notify([ch[len(prefix) :]])

        def on_down(exc: Exception) -> None:
            self.live = False
            for c in hub.caches:
                c.clear()
            log.warning("feed_listener_down", error=str(exc)[:300])

        redis.follow(url, lambda p: p.psubscribe(prefix + "*"), on_message, on_down, RETRY_S)


_listener = _Listener()


class SqliteWatcher:
    """Wakes every waiter when another connection (the worker process) committed to the SQLite
    database: `PRAGMA data_version` on a connection of its own, while anyone waits."""

    INTERVAL_S = 0.2

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def ensure(self, path: str) -> None:
        if self.thread is not None and self.thread.is_alive() and self.pid == os.getpid():
            return
        with self.lock:
            if self.thread is None or not self.thread.is_alive() or self.pid != os.getpid():
                self.pid = os.getpid()
                self.thread = threading.Thread(
                    target=self._run, args=(path,), daemon=True, name="feed-sqlite-watcher"
                )
                self.thread.start()

    def _run(self, path: str) -> None:
        import sqlite3

        version = None
        conn = None
        while not self.stopped.is_set():
            try:
                if not len(hub):
                    version = None  # nobody waits: look again once someone does
                    time.sleep(self.INTERVAL_S)
                    continue
                if conn is None:
                    conn = sqlite3.connect(path, timeout=5, check_same_thread=False)
                now = conn.execute("PRAGMA data_version").fetchone()[0]
                if version is not None and now != version:
                    hub.notify_all()
                version = now
            except Exception as exc:
                log.warning("feed_sqlite_watcher_failed", error=str(exc)[:300])
                conn, version = None, None
            time.sleep(self.INTERVAL_S)
        if conn is not None:
            conn.close()


_watcher = SqliteWatcher()
