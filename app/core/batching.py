"""Group commit: items that arrive while a batch is being written are written together next.

Work whose cost is mostly its transaction's (a row lock many writers share, a version bump that
makes readers read everything again) is cheaper in one transaction for many callers than in
one each. `GroupCommit.submit` queues an item and waits for its result without holding a worker
thread; one batch at a time runs in the thread pool (per event loop), and what arrived
meanwhile is the next batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio.to_thread

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Queue:
    items: list[tuple[Any, asyncio.Future]] = field(default_factory=list)
    drainer: asyncio.Task | None = None


class GroupCommit(Generic[T, R]):
    """`run(items)` returns, for each item in order, its result or the exception it raised
    (one item's failure need not fail the others); it runs on a worker thread, one batch at a
    time, at most `max_batch` items each."""

    def __init__(self, run: Callable[[list[T]], list[R | BaseException]], max_batch: int = 256):
        self.run = run
        self.max_batch = max_batch
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = (
            weakref.WeakKeyDictionary()
        )

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        q = self._queues.get(loop)
        if q is None:
            q = self._queues[loop] = _Queue()
        fut: asyncio.Future = loop.create_future()
        q.items.append((item, fut))
        if q.drainer is None:
            # A context of its own: the batch is no one request's (its logs carry none's id).
            q.drainer = loop.create_task(self._drain(q), context=contextvars.Context())
        return await fut

    async def _drain(self, q: _Queue) -> None:
        try:
            while q.items:
                batch, q.items = q.items[: self.max_batch], q.items[self.max_batch :]
                try:
                    results: list[Any] = await anyio.to_thread.run_sync(
                        self.run, [item for item, _ in batch]
                    )
                except asyncio.CancelledError:  # the loop is closing: nothing more is run
                    for _, fut in batch + q.items:
                        fut.cancel()
                    q.items = []
                    raise
                except Exception as exc:
                    results = [exc] * len(batch)
                if len(results) != len(batch):  # never leave a caller waiting forever
                    wrong = RuntimeError(f"a batch of {len(batch)} gave {len(results)} results")
                    results = [wrong] * len(batch)
                for (_, fut), result in zip(batch, results, strict=True):
                    if fut.done():  # its caller went away
                        continue
                    if isinstance(result, BaseException):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
        finally:
            q.drainer = None
