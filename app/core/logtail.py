"""The settled end of an append-only log table (`workload_events`, `health_events`): the highest
id at or below which no row can still appear. Readers that follow such a log (GraphQL
subscriptions) read only up to it, in id order, so the id of the last row they delivered is an
exact place to resume from: nothing below it can turn up later.

Why it is needed: on PostgreSQL ids come from a sequence when a row is inserted, and
transactions commit in any order, so a row with a lower id can become visible after a higher
one (A takes 100, B takes 101, B commits, then A does). A reader that moved past 101 would never
see 100. So the tail looks at the ids above its horizon; the horizon moves up over visible ids
and stops below the first gap (an id not visible) until that gap is settled: either its row
becomes visible, or every transaction that could hold it has ended, which makes it an id a
rolled-back transaction used up. "Could hold it": the transactions in progress (the snapshot's
`xip` list) `GRACE_S` or more after the gap was first seen, by which time the holder of an id
taken from the sequence has its transaction id; their ending is read from later snapshots.

The cost: a rolled-back id holds readers back until the transactions in progress when it was
seen have ended (any of them might hold it; PostgreSQL cannot say which), usually a fraction of
a second, at most `MAX_WAIT_S` behind a long-running writer. The edge that remains, honestly: a
gap still open after `MAX_WAIT_S` (a transaction that writes events and then stays open that
long, or one that stalls for over `GRACE_S` between taking an id and its first write) is given
up on, with a warning in the log, so a row that then appears below the horizon is not delivered
to readers that had passed it (REST and queries still show it). On SQLite one writer at a time
commits in id order, so the horizon is the highest visible id; the one edge there is an id
reused after the highest rows are deleted. A table emptied under a running process (tests
truncate) resets the horizon.

One tail per table and process, shared by all its readers: one query per wake-up, whatever the
number of subscribers. Each refresh reads only ids above the horizon (by the primary key).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from app.core.db import get_engine
from app.core.logging import get_logger

log = get_logger(__name__)


@dataclass
class _Gap:
    lo: int  # a run of missing ids, lo..hi
    hi: int
    seen: float  # monotonic time first seen
    watch: frozenset[int] | None = None  # transactions that could hold it (GRACE_S after seen)


@dataclass
class _State:
    horizon: int | None = None
    gaps: list[_Gap] = field(default_factory=list)
    done_start: float = -1.0  # when the last completed refresh started


class LogTail:
    GRACE_S = 0.2
    MAX_WAIT_S = 30.0
    BATCH = 5000
    START_BACK = 1000  # a new process looks this many ids below the newest for open gaps

    def __init__(self, table: str):
        self.table = table
        self.state = _State()
        self.lock = threading.Lock()
        self._inflight: dict[asyncio.AbstractEventLoop, tuple[float, asyncio.Future]] = {}

    async def horizon(self, since: float) -> tuple[int, bool]:
        """(The horizon, whether gaps hold it back) from a refresh that started at `since` or
        later (monotonic): one that sees everything committed before `since`. Readers woken
        together share one refresh."""
        st = self.state
        if st.done_start >= since and st.horizon is not None:
            return st.horizon, bool(st.gaps)
        loop = asyncio.get_running_loop()
        cur = self._inflight.get(loop)
        if cur is None or cur[0] < since:
            start = time.monotonic()
            fut: asyncio.Future = asyncio.ensure_future(run_in_threadpool(self.refresh, start))
            cur = self._inflight[loop] = (start, fut)
            entry = cur

            def forget(_f: asyncio.Future) -> None:
                if self._inflight.get(loop) is entry:
                    del self._inflight[loop]

            fut.add_done_callback(forget)
        return await asyncio.shield(cur[1])

    def refresh(self, start: float) -> tuple[int, bool]:
        with self.lock:
            st = self.state
            if st.done_start < start or st.horizon is None:
                with get_engine().connect() as conn:
                    if conn.dialect.name == "postgresql":
                        self._advance_pg(conn)
                    else:
                        top = conn.execute(text(f"SELECT max(id) FROM {self.table}")).scalar()
                        st.horizon, st.gaps = int(top or 0), []
                    conn.rollback()
                st.done_start = max(st.done_start, start)
            assert st.horizon is not None
            return st.horizon, bool(st.gaps)

    def _advance_pg(self, conn) -> None:
        st = self.state
        top = conn.execute(text(f"SELECT max(id) FROM {self.table}")).scalar() or 0
        if st.horizon is None or top < st.horizon:
            if st.horizon is not None:
                log.warning("log_tail_reset", table=self.table, horizon=st.horizon, top=top)
            st.horizon, st.gaps = max(0, top - self.START_BACK), []
        for _ in range(100):  # a batch at a time; a new process or a long pause has many
            # One statement, so one snapshot: the ids it sees and the transactions it doesn't.
            snap, ids = conn.execute(
                text(
                    "SELECT pg_current_snapshot()::text, ARRAY(SELECT id FROM "
                    f"{self.table} WHERE id > :h ORDER BY id LIMIT :n)"
                ),
                {"h": st.horizon, "n": self.BATCH},
            ).one()
            xip = frozenset(int(x) for x in snap.split(":")[2].split(",") if x)
            if not self._walk(list(ids), xip) or len(ids) < self.BATCH:
                return

    def _walk(self, ids: list[int], xip: frozenset[int]) -> bool:
        """Move the horizon over `ids` (sorted, all above it) and settled gaps; False when an
        open gap stops it."""
        st = self.state
        now = time.monotonic()
        assert st.horizon is not None
        expected = st.horizon + 1
        known = st.gaps
        gaps: list[_Gap] = []
        for i in ids:
            if i > expected:
                gap = next((g for g in known if g.lo <= expected <= g.hi), None)
                if gap is None:
                    gap = _Gap(expected, i - 1, now)
                else:  # part of a gap seen before (split, if a row inside it appeared)
                    gap = _Gap(expected, i - 1, gap.seen, gap.watch)
                gaps.append(gap)
            expected = i + 1
        horizon = ids[-1] if ids else st.horizon
        for g in gaps:
            age = now - g.seen
            if age >= self.GRACE_S and g.watch is None:
                g.watch = xip
            settled = g.watch is not None and not (g.watch & xip)
            if not settled and age >= self.MAX_WAIT_S:
                log.warning("log_tail_gap_given_up", table=self.table, lo=g.lo, hi=g.hi)
                settled = True
            if not settled:
                horizon = g.lo - 1
                break
        st.horizon = horizon
        st.gaps = [g for g in gaps if g.lo > horizon]
        return not st.gaps


_tails: dict[str, LogTail] = {}


def tail(table: str) -> LogTail:
    if table not in _tails:
        _tails[table] = LogTail(table)
    return _tails[table]
