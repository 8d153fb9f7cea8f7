"""A month's usage segments for a bill that is read again and again (the portal's dashboard,
the upcoming invoice), without reading the month's ledger each time.

The segments up to a whole minute `h` two minutes ago are kept, per tenant and month, with what was
still held at `h` (milli-GPU per group). They stay right while the ledger holds the same
events before `h`: each request counts them (the ledger is append-only), and a late event (or
a correction) dated before `h` has the month read again. When the minute turns they move on
by what happened in between; a request reads only what happened since `h` (on the ledger's
(tenant, instant) index) and adds it:

- what was held at `h`, as if still held up to now;
- minus, for each allocation held at `h` that stopped since, the time from its stop to now
  (plus, for a stop dated after now, the time from now to its stop, as the full reading
  counts it);
- the allocations started since `h`, and the adjustments dated since `h`.

That is the same sum the full reading makes (tests/test_bill_live.py compares them), so the
answer does not depend on the cache. The full reading is used where the sum is not linear:
a tenant with commitments (their split is per hour of total use), or a caller that is not
one tenant. Groups that sum to nothing are left out (an allocation held at `h` and stopped
at `h` adds and takes away the same).
"""

from __future__ import annotations

import threading
import uuid
from bisect import bisect_right
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.billing import commitments
from app.metering import service as metering
from app.metering.models import UsageEvent

STEP_MS = 60_000  # the kept segments end at a whole minute...
# ...this long ago: usage events reach the ledger a little after their instant (a stop
# recorded a second after the minute turned), and one dated before the kept end has the month
# read again. Later ones still do, rarely.
SETTLE_MS = 120_000
# How far before its month an event may still arrive and change the month's bill unseen.
LATE = timedelta(days=62)
_KEPT = 1024


@dataclass(frozen=True)
class _Kept:
    h: int  # the segments cover [month start, h)
    seen: int  # ledger events dated in [month start - LATE, h) when they were read
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
    if kept is not None and (kept.h > h or _seen(session, scope, lo, kept.h) != kept.seen):
        kept = None  # an event dated before its end has arrived since (or an earlier `now`)
    if kept is None:
        kept = _keep(session, scope, cuts, h)
    elif kept.h < h:
        kept = _advance(session, scope, cuts, kept, h)
    with _lock:
        _kept[key] = kept
        _kept.move_to_end(key)
        while len(_kept) > _KEPT:
            _kept.popitem(last=False)
    out: dict[tuple[int, tuple], int] = defaultdict(int, kept.segments)
    if h < hi:
        _add_since(out, session, scope, cuts, h, now_ms, kept.held)
    return _by_plan(out)


def _seen(session: Session, scope, lo: int, h: int) -> int:
    """Ledger events dated in [lo - LATE, h): one count on the (tenant, instant) index. The
    ledger is append-only, so the same count is the same events."""
    return session.scalar(
        scope(
            select(func.count()).where(
                UsageEvent.occurred_at >= metering.from_ms(lo) - LATE,
                UsageEvent.occurred_at < metering.from_ms(h),
            )
        )
    )


def _advance(session: Session, scope, cuts: list[int], kept: _Kept, h: int) -> _Kept:
    """The kept segments moved on from `kept.h` to `h`: what happened in between, read on the
    index, clipped at `h`."""
    pick = metering.picker(commitments._PLAIN)
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
    upto = [c for c in cuts if c < h] + [h]
    metering.spread(segments, [s for s in spans if s[1] > s[0]], upto)
    for adj in adjustments:
        seg = upto[bisect_right(upto, adj.at_ms) - 1]
        segments[(seg, pick(adj.dims))] += adj.quantity
    return _Kept(
        h,
        _seen(session, scope, cuts[0], h),
        dict(segments),
        {g: m for g, m in held.items() if m},
    )


def _keep(session: Session, scope, cuts: list[int], h: int) -> _Kept:
    """The month read in full, up to `h`."""
    lo, hi = cuts[0], cuts[-1]
    seen = _seen(session, scope, lo, h)
    intervals, adjustments = metering.read(
        session, scope, metering.from_ms(lo), metering.from_ms(hi)
    )
    before = [c for c in cuts if c < h] + [h] if h > lo else [lo, lo]
    pick = metering.picker(commitments._PLAIN)
    segments: dict[tuple[int, tuple], int] = {}
    if h > lo:
        early = [iv for iv in intervals if iv.start_ms < h]
        segments = dict(
            metering.segmentize(
                early, adjustments, before, commitments._PLAIN, now=metering.from_ms(h)
            )
        )
    held: dict[tuple, int] = defaultdict(int)
    for iv in intervals:
        if iv.start_ms < h and (iv.stop_ms is None or iv.stop_ms >= h):
            held[pick(iv.dims)] += iv.gpu_milli
    return _Kept(h, seen, segments, dict(held))


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
    pick = metering.picker(commitments._PLAIN)
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
