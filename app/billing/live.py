"""A month's usage segments for a bill that is read again and again (the portal's dashboard,
the upcoming invoice), without reading the month's ledger each time.

The segments up to a whole minute `h` two minutes ago are kept, per tenant and month, with what was
still held at `h` (milli-GPU per group). They stay right while the ledger holds the same
events before `h`. The ledger is append-only, so what can change them is an event that arrives
later, dated before `h` (late, or a correction): it has the month read again. The proof is by
the ledger's settled id horizon (app/core/logtail.py: the id at or below which no row can
still appear). Kept segments carry such a horizon `upto`, and hold every event of the tenant
dated before `h` with an id at or below it, and no other; a request looks for an event of the
tenant with an id above `upto` dated before `h` (on the primary key: the ids since the last
request, whatever the month holds), and finding none, moves `upto` up to the horizon it read
first. Segments that hold an event above their horizon (not yet settled: one dated before `h`
arrived in the last moments, or the caller's own transaction wrote it) answer that request
but are not kept. The edge is the horizon's: a writer whose transaction stays open past
`LogTail.MAX_WAIT_S` with an event dated before `h` is not seen (the count of the month's
events this replaced saw it, at a cost linear in the month). When the minute turns they move
on by what happened in between; a request reads only what happened since `h` (on the ledger's
(tenant, instant) index) and adds it:

- what was held at `h`, as if still held up to now;
- minus, for each allocation held at `h` that stopped since, the time from its stop to now
  (plus, for a stop dated after now, the time from now to its stop, as the full reading
  counts it);
- the allocations started since `h`, and the adjustments dated since `h`.

That is the same sum the full reading makes (tests/billing/test_live.py compares them), so the
answer does not depend on the cache. The full reading is used where the sum is not linear:
a tenant with commitments (their split is per hour of total use), or a caller that is not
one tenant. Groups that sum to nothing are left out (an allocation held at `h` and stopped
at `h` adds and takes away the same).
"""

from __future__ import annotations

import threading
import time
import uuid
from bisect import bisect_right
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.billing import commitments
from app.core.logtail import tail
from app.metering import service as metering
from app.models.metering import UsageEvent

STEP_MS = 60_000  # the kept segments end at a whole minute...
# ...this long ago: usage events reach the ledger a little after their instant (a stop
# recorded a second after the minute turned), and one dated before the kept end has the month
# read again. Later ones still do, rarely.
SETTLE_MS = 120_000
# A request that only checks kept segments takes the ledger's horizon as it was this recently
# (any settled horizon proves; an older one leaves more ids to look at). One that reads the
# ledger (the month, or the minutes since the kept end) reads the horizon first.
HORIZON_S = 1.0
_KEPT = 1024
LEDGER = tail(UsageEvent.__tablename__)


@dataclass(frozen=True)
class _Kept:
    h: int  # the segments cover [month start, h)
    upto: int  # every event of the tenant dated before h with an id <= upto is in, no other
    segments: dict[tuple[int, tuple], int]  # by (segment start, group)
    held: dict[tuple, int]  # milli-GPU per group held at h


_kept: OrderedDict[tuple, _Kept] = OrderedDict()
_lock = threading.Lock()


def usage_by_plan(
    session: Session, scope, tenant_id: uuid.UUID | None, cuts: list[int], now_ms: int
) -> commitments.Segments:
    """`commitments.usage_by_plan(session, scope, cuts, now)`, from the kept segments where
    the sum is linear (see the module)."""
    lo, hi = cuts[0], cuts[-1]
    now = metering.from_ms(now_ms)
    settled = now_ms - SETTLE_MS
    h = max(lo, min(hi, settled - settled % STEP_MS))
    if tenant_id is None or commitments.load(
        session, scope, metering.from_ms(lo), metering.from_ms(hi)
    ):
        return commitments.usage_by_plan(session, scope, cuts, now=now)
    key = (tenant_id, tuple(cuts))
    with _lock:
        kept = _kept.get(key)
    # Before any read below: every id at or below the horizon is visible to them (each
    # statement sees what committed before it began, PostgreSQL's READ COMMITTED).
    upto = _horizon(fresh=kept is None or kept.h != h)
    if kept is not None and (kept.h > h or kept.upto > upto or _late(session, scope, kept)):
        kept = None  # an event dated before its end has arrived since (or an earlier `now`)
    keep = None
    if kept is not None:
        keep = kept = replace(kept, upto=upto)
    if kept is None:
        kept = _keep(session, scope, cuts, h, upto)
    elif kept.h < h:
        kept = _advance(session, scope, cuts, kept, h, upto)
    if kept is not keep and not _late(session, scope, kept):
        keep = kept  # it holds no event above its horizon: kept
    if keep is not None:
        with _lock:
            _kept[key] = keep
            _kept.move_to_end(key)
            while len(_kept) > _KEPT:
                _kept.popitem(last=False)
    out: dict[tuple[int, tuple], int] = defaultdict(int, kept.segments)
    if h < hi:
        _add_since(out, session, scope, cuts, h, now_ms, kept.held)
    return _by_plan(out)


def _horizon(fresh: bool) -> int:
    """The ledger's settled id horizon: read now if `fresh`, else as of `HORIZON_S` ago."""
    state = LEDGER.state
    if fresh or state.horizon is None or time.monotonic() - state.done_start > HORIZON_S:
        return LEDGER.refresh(time.monotonic())[0]
    return state.horizon


def _late(session: Session, scope, kept: _Kept) -> bool:
    """Whether the ledger holds an event of the scope with an id above `kept.upto` dated
    before `kept.h`: read from the primary key's end, one row at most."""
    found = session.scalar(
        scope(
            select(UsageEvent.id)
            .where(UsageEvent.id > kept.upto, UsageEvent.occurred_at < metering.from_ms(kept.h))
            .order_by(UsageEvent.id)
            .limit(1)
        )
    )
    return found is not None


def _advance(session: Session, scope, cuts: list[int], kept: _Kept, h: int, upto: int) -> _Kept:
    """The kept segments moved on from `kept.h` to `h`: what happened in between, read on the
    index, clipped at `h`."""
    pick = metering.picker(commitments.PLAIN)
    started, stopped, adjustments = metering.read_since(
        session, scope, metering.from_ms(kept.h), metering.from_ms(h)
    )
    held = defaultdict(int, kept.held)
    spans = [(kept.h, h, milli, group) for group, milli in kept.held.items()]
    for iv in stopped:  # held at kept.h, stopped before h
        group = pick(iv.dims)
        assert iv.stop_ms is not None
        spans.append((iv.stop_ms, h, -iv.gpu_milli, group))
        held[group] -= iv.gpu_milli
    for iv in started:
        group = pick(iv.dims)
        stop = iv.stop_ms if iv.stop_ms is not None and iv.stop_ms < h else h
        spans.append((iv.start_ms, stop, iv.gpu_milli, group))
        if stop == h and (iv.stop_ms is None or iv.stop_ms >= h):
            held[group] += iv.gpu_milli
    segments: dict[tuple[int, tuple], int] = defaultdict(int, kept.segments)
    before = [c for c in cuts if c < h] + [h]
    metering.spread(segments, [s for s in spans if s[1] > s[0]], before)
    for adj in adjustments:
        seg = before[bisect_right(before, adj.at_ms) - 1]
        segments[(seg, pick(adj.dims))] += adj.quantity
    return _Kept(h, upto, dict(segments), {g: m for g, m in held.items() if m})


def _keep(session: Session, scope, cuts: list[int], h: int, upto: int) -> _Kept:
    """The month read in full, up to `h`."""
    lo, hi = cuts[0], cuts[-1]
    intervals, adjustments = metering.read(
        session, scope, metering.from_ms(lo), metering.from_ms(hi)
    )
    before = [c for c in cuts if c < h] + [h] if h > lo else [lo, lo]
    pick = metering.picker(commitments.PLAIN)
    segments: dict[tuple[int, tuple], int] = {}
    if h > lo:
        early = [iv for iv in intervals if iv.start_ms < h]
        segments = dict(
            metering.segmentize(
                early, adjustments, before, commitments.PLAIN, now=metering.from_ms(h)
            )
        )
    held: dict[tuple, int] = defaultdict(int)
    for iv in intervals:
        if iv.start_ms < h and (iv.stop_ms is None or iv.stop_ms >= h):
            held[pick(iv.dims)] += iv.gpu_milli
    return _Kept(h, upto, segments, dict(held))


def _add_since(
    out: dict[tuple[int, tuple], int],
    session: Session,
    scope,
    cuts: list[int],
    h: int,
    now_ms: int,
    held: dict[tuple, int],
) -> None:
    hi = cuts[-1]
    tail = cuts[bisect_right(cuts, h) - 1 :]  # from the segment h is in
    pick = metering.picker(commitments.PLAIN)
    started, stopped, adjustments = metering.read_since(
        session, scope, metering.from_ms(h), metering.from_ms(hi)
    )
    upto = min(max(now_ms, h), hi)
    spans = [(h, upto, milli, group) for group, milli in held.items()]
    for iv in stopped:  # held at h, stopped since
        group = pick(iv.dims)
        stop = iv.stop_ms
        assert stop is not None
        if stop < upto:
            spans.append((stop, upto, -iv.gpu_milli, group))
        elif stop > upto:
            spans.append((upto, min(stop, hi), iv.gpu_milli, group))
    for iv in started:
        end = iv.stop_ms if iv.stop_ms is not None else max(now_ms, iv.start_ms)
        spans.append((iv.start_ms, min(end, hi), iv.gpu_milli, pick(iv.dims)))
    metering.spread(out, [s for s in spans if s[1] > s[0]], tail)
    for adj in adjustments:
        seg = tail[bisect_right(tail, adj.at_ms) - 1]
        out[(seg, pick(adj.dims))] += adj.quantity


def _by_plan(segments: dict[tuple[int, tuple], int]) -> commitments.Segments:
    out: commitments.Segments = defaultdict(int)
    for (seg, (*dims, priority)), q in segments.items():
        if q:
            out[(seg, (*dims, commitments.plan_of(priority).value))] += q
    return out


def clear() -> None:
    with _lock:
        _kept.clear()
