"""Group commit (app/core/batching.py), which judges a fleet's finished burn-ins: what arrives
while a batch is written is written together next, one batch at a time, and one item's failure
is only its own. No database; no timed assertions (the first batch is held by an event)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.core.batching import GroupCommit


def test_items_arriving_during_a_batch_are_taken_together_next():
    batches: list[list[int]] = []
    release = threading.Event()
    started = threading.Event()

    def run(items: list[int]) -> list[int | BaseException]:
        batches.append(list(items))
        if len(batches) == 1:
            started.set()
            release.wait(30)
        return [ValueError(i) if i == 13 else i * 10 for i in items]

    group: GroupCommit[int, int] = GroupCommit(run)

    async def main() -> list:
        first = asyncio.create_task(group.submit(1))
        await asyncio.to_thread(started.wait, 30)  # the first batch runs, and holds
        rest = [asyncio.create_task(group.submit(i)) for i in (2, 13, 4)]
        await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    out = asyncio.run(main())
    assert batches == [[1], [2, 13, 4]], "one transaction for what arrived meanwhile"
    assert out[0] == 10 and out[1] == 20 and out[3] == 40
    assert isinstance(out[2], ValueError), "a failure is its own item's"


def test_a_batch_that_raises_fails_its_items_and_the_next_still_runs():
    calls = 0

    def run(items: list[str]) -> list[str | BaseException]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("database gone")
        return [s.upper() for s in items]

    group: GroupCommit[str, str] = GroupCommit(run)

    async def main() -> str:
        with pytest.raises(RuntimeError):
            await group.submit("a")
        return await group.submit("b")

    assert asyncio.run(main()) == "B"
