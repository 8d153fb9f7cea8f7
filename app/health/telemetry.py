"""Telemetry in: DCGM samples from node agents, as JSON or as dcgm-exporter's Prometheus text.

What is kept is what the health logic needs, per process and in memory (`telemetry_state.py`):
each GPU's counters' last values (deltas are taken against them), the last Xid and recovery
action seen, latest gauges, and exponentially weighted aggregates for the performance score.
The database gets:
- at once, in the request's transaction: the fault signals (an outbox message per node for
  `health.evaluate`) and the aggregates of the GPUs that raised them (so a restart does not
  take an old Xid for a new one);
- heartbeats, at most every third of the heartbeat timeout per node;
- each GPU's aggregates at most every `telemetry_flush_seconds`, and its performance score when
  it moves by `perf.WRITE_STEP`.
All batched: one statement per kind of write per request.

Several API processes each keep the GPUs they are sent; a GPU's state is read from the
database the first time a process sees it, so baselines carry across processes and restarts.
If the request's transaction rolls back, the nodes it raised signals for (or learned a GPU's
UUID for) are forgotten, so the next report raises them again.

Nothing is taken on trust: a sample outside its field's domain (`DOMAINS` in `dcgm.py`: an Xid
of -1, a negative counter, Inf, a temperature of 5000 C), stamped more than MAX_SKEW_S ahead of
the server's clock, with a malformed label, or claiming the UUID of another GPU is rejected on
its own (counted, with its reason, never acted on) and the rest of the batch still applies. A
UUID resolves only to the GPU whose record holds it, or to nothing.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, bindparam, case, event, literal, or_, update
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import dialect_insert, utcnow
from app.health.actions import HW_SLOWDOWN_BITS, SIGNALS, THROTTLED_BITS
from app.health.dcgm import (
    BAD_LABEL,
    CLOCK,
    DOMAINS,
    FIELDS,
    FLAG,
    FUTURE_TIMESTAMP,
    GAUGE,
    RECOVERY,
    REJECTED_TARGETS,
    THROTTLE,
    UTIL,
    XID,
    invalid,
)
from app.health.dcgm import parse_exposition as parse_exposition  # the API parses with it
from app.health.metrics import TELEMETRY_REJECTED
from app.health.telemetry_state import PARTITIONED, GpuState, NodeState, Telemetry
from app.models.fleet import Gpu
from app.models.health import GpuTelemetry, NodeHeartbeat
from app.outbox.service import enqueue
from app.placement import perf

# Counters whose signal is a rate (a rise of `threshold` within RATE_WINDOW_S), not any rise.
RATE_WINDOW_S = 60.0
# A sample's own timestamp is trusted within this much of the server's clock (agents' clocks
# drift): a fault is dated by it, and so is the end of the usage it interrupts. One stamped
# further ahead is rejected.
MAX_SKEW_S = 120.0
MAX_PROBLEMS = 100
# A node has an agent (its silence is a fault) once its reports came as a stream of this many
# heartbeats over this share of the heartbeat timeout (see `_beat`).
AGENT_BEATS = 3
AGENT_SPAN = 2 / 3


@dataclass
class Signal:
    """A fault signal: what `health.evaluate` classifies and acts on."""

    gpu_index: int | None
    signal: str  # "xid", "recovery_action" or a SIGNALS name
    code: int | None
    value: float
    at: float  # epoch seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "gpu_index": self.gpu_index,
            "signal": self.signal,
            "code": self.code,
            "value": self.value,
            "at": self.at,
        }


@dataclass
class IngestResult:
    accepted: int = 0
    ignored: int = 0
    unknown: list[dict[str, Any]] = field(default_factory=list)
    unknown_count: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    rejections: list[dict[str, Any]] = field(default_factory=list)
    nodes: int = 0
    signals: int = 0
    db_writes: int = 0

    def reply(self) -> dict[str, Any]:
        """What the push routes answer (TelemetryResult): all but the internal write count."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "db_writes"}


_STATE: dict[str, Telemetry] = {}
_TOUCHED = "rackplane_telemetry_signalled"


def state_for(session: Session) -> Telemetry:
    """The process's telemetry state for this database (tests run several databases)."""
    key = str(session.get_bind().engine.url)
    t = _STATE.get(key)
    if t is None:
        t = _STATE[key] = Telemetry()
    return t


@event.listens_for(Session, "after_rollback")
def _forget_signalled(session: Session) -> None:
    names = session.info.pop(_TOUCHED, None)
    if names:
        state_for(session).forget(names)


@event.listens_for(Session, "after_commit")
def _signals_committed(session: Session) -> None:
    session.info.pop(_TOUCHED, None)


# --- the pass over a batch -------------------------------------------------------------------


@dataclass
class _Pass:
    """What a batch's samples did to this process's state, for the writes that follow."""

    batch: int
    touched: list[GpuState] = field(default_factory=list)  # GPUs with an accepted sample
    signals: dict[str, list[Signal]] = field(default_factory=dict)  # by hostname
    learned: list[tuple[GpuState, str]] = field(default_factory=list)  # UUIDs to record
    raised: list[GpuState] = field(default_factory=list)  # GPUs that raised a signal


def ingest(
    session: Session,
    samples: list[tuple],
    targets: dict[Any, tuple],
    *,
    heartbeat_nodes: list[str] | None = None,
) -> IngestResult:
    """Apply a parsed batch: samples as (reference, target key, field, value, timestamp);
    targets as key -> (hostname, GPU index, UUID), or BAD_LABEL. Returns what was accepted,
    what names no fleet GPU and what was rejected and why (per sample, the first MAX_PROBLEMS
    of each), and the writes made."""
    settings = get_settings()
    tel = state_for(session)
    res = IngestResult()
    now = time.time()
    with tel.lock:
        if heartbeat_nodes:
            for host in heartbeat_nodes:
                targets[("node", host)] = (host, None, None)
        resolved = tel.resolve(session, targets)
        tel.batch += 1
        p = _Pass(tel.batch)
        _take_samples(p, res, samples, targets, resolved, now)
        nodes = _reporting(tel, res, resolved, heartbeat_nodes, now)
        flush, perf_moves = _fold(tel, p, now, settings.telemetry_flush_seconds)
        beats = _due_beats(nodes, now, settings.heartbeat_timeout_seconds / 3)
        res.nodes = len(nodes)
        rows_flush = [_telemetry_row(g, now) for g in flush]
        perf_rows = [{"g_id": g.gpu_id, "g_perf": g.perf} for g in perf_moves]
        uuid_rows = [{"g_id": g.gpu_id, "g_uuid": u} for g, u in p.learned]
        _learn_uuids(tel, p.learned)
    for why, n in res.rejected_by_reason.items():
        TELEMETRY_REJECTED.labels(why).inc(n)
    # What this process now believes of these nodes is undone if the transaction rolls back
    # (`_forget_signalled`): told before the writes, any of which may fail.
    touched_hosts = set(p.signals) | {g.host for g, _u in p.learned}
    if touched_hosts:
        session.info.setdefault(_TOUCHED, set()).update(touched_hosts)
    # The writes, outside the lock: one statement each.
    writes = 0
    if beats:
        _beat(session, [n.node_id for n in beats], now, settings.heartbeat_timeout_seconds)
        writes += len(beats)
    writes += _write_rows(session, rows_flush, perf_rows, uuid_rows, now)
    writes += _send_signals(session, tel, res, p.signals, now)
    res.db_writes = writes
    return res


def _take_samples(
    p: _Pass,
    res: IngestResult,
    samples: list[tuple],
    targets: dict[Any, tuple],
    resolved: dict[Any, GpuState | str],
    now: float,
) -> None:
    """Check each sample and learn from those accepted: gauges kept, events and counters
    compared with what was seen before (and the signals they raise). The hot path."""
    horizon = now + MAX_SKEW_S
    batch, touched, signals, learned, raised = p.batch, p.touched, p.signals, p.learned, p.raised
    fields, domains = FIELDS, DOMAINS
    for ref, tkey, name, value, ts in samples:
        f = fields.get(name)
        if f is None:
            res.ignored += 1
            continue
        g = resolved[tkey]
        if isinstance(g, str):
            if g is PARTITIONED:  # never arrived
                continue
            if g in REJECTED_TARGETS:
                _reject(res, ref, targets[tkey], name, g)
                continue
            res.unknown_count += 1
            if len(res.unknown) < MAX_PROBLEMS:
                host, index, uuid_ = targets[tkey]
                res.unknown.append(
                    {"sample": ref, "node": host, "gpu": index, "uuid": uuid_, "problem": g}
                )
            continue
        # Checked before anything is learned from it: a rejected sample is not acted on.
        kind, key = f
        lo, hi, whole = domains[key]
        if ts is not None and ts > horizon:
            why = FUTURE_TIMESTAMP
        elif lo <= value <= hi and not (whole and value % 1):
            why = None  # the common case, inline (this loop is the hot path)
        else:
            why = invalid(kind, value)
        if why is not None:
            _reject(res, ref, targets[tkey], name, why)
            continue
        res.accepted += 1
        t = ts if ts is not None else now
        if t > g.ts:
            g.ts = t
        if g.seen != batch:
            g.seen = batch
            touched.append(g)
            uuid_ = targets[tkey][2]
            if uuid_ and uuid_ != g.uuid:
                learned.append((g, uuid_))
        if value != value:  # NaN: a gauge's "no reading", nothing to learn
            continue
        if kind == GAUGE:
            g.latest[key] = value
        elif kind == UTIL:
            g.util = value
        elif kind == CLOCK:
            g.clock = value
        elif kind == THROTTLE:
            g.throttle = int(value)
        else:
            s = _event(g, kind, key, value, _when(ts, now))
            if s is not None:
                signals.setdefault(g.host, []).append(s)
                raised.append(g)


def _reporting(
    tel: Telemetry,
    res: IngestResult,
    resolved: dict[Any, GpuState | str],
    heartbeat_nodes: list[str] | None,
    now: float,
) -> dict[str, NodeState]:
    """The nodes heard from: those of the GPUs the batch names, and those whose heartbeats
    came with it (a name not in the fleet is counted as unknown)."""
    nodes: dict[str, NodeState] = {}
    for g in resolved.values():
        if not isinstance(g, str) and g.host not in nodes and g.host in tel.nodes:
            nodes[g.host] = tel.nodes[g.host]
    if heartbeat_nodes:
        for host in heartbeat_nodes:
            if host not in tel.nodes:
                res.unknown_count += 1
                if len(res.unknown) < MAX_PROBLEMS:
                    res.unknown.append(
                        {
                            "sample": None,
                            "node": host,
                            "gpu": None,
                            "uuid": None,
                            "problem": "unknown_node",
                        }
                    )
            elif not tel.nodes[host].partitioned:
                nodes[host] = tel.nodes[host]
                nodes[host].ts = max(nodes[host].ts, now)
    return nodes


def _fold(
    tel: Telemetry, p: _Pass, now: float, every: float
) -> tuple[list[GpuState], list[GpuState]]:
    """Aggregates, once per GPU per batch. Returns the GPUs whose aggregates are written now
    (every `every` seconds of the samples' time, and any that raised a signal) and those whose
    performance score moved enough to write."""
    flush: list[GpuState] = []
    perf_moves: list[GpuState] = []
    for g in p.touched:
        owner = tel.nodes.get(g.host)
        if owner is not None and g.ts > owner.ts:
            owner.ts = g.ts
        s = _aggregate(g, now)
        if s is not None:
            p.signals.setdefault(g.host, []).append(s)
            p.raised.append(g)
        score = perf.from_telemetry(g.clock_ratio, g.throttled, g.samples, g.nominal is not None)
        if score is not None and perf.worth_writing(g.perf, score):
            g.perf = score
            perf_moves.append(g)
        # Cadence in the samples' time: what happens in 30 s of the agents' clocks is what
        # happens in 30 s of the fleet's life (a benchmark that replays faster writes the
        # same rows per sample as the fleet would).
        if g.ts - g.flushed_at >= every:
            flush.append(g)
    # A GPU that raised a signal has its aggregates written with it (a restart must not take
    # the Xid still showing for a new one).
    in_flush = {id(g) for g in flush}
    for g in p.raised:
        if id(g) not in in_flush:
            in_flush.add(id(g))
            flush.append(g)
    for g in flush:
        g.flushed_at = max(g.ts, g.flushed_at)
    return flush, perf_moves


def _due_beats(nodes: dict[str, NodeState], now: float, beat_every: float) -> list[NodeState]:
    """The nodes whose heartbeats are written. A heartbeat says when the server last heard
    from the node: it is written at most every `beat_every` of the server's clock, or of the
    node's samples' (a replay faster than real time writes as many as the fleet would).
    Neither clock is compared with the other, so no stamp an agent sends can hold its
    heartbeats back."""
    beats = []
    for node in nodes.values():
        if node.out or now - node.written_at >= beat_every or node.ts - node.beat_ts >= beat_every:
            node.written_at, node.beat_ts = now, node.ts
            beats.append(node)
    return beats


def _learn_uuids(tel: Telemetry, learned: list[tuple[GpuState, str]]) -> None:
    """The UUIDs the batch taught name their GPUs in this process from now on."""
    for g, u in learned:
        if g.uuid and tel.by_uuid.get(g.uuid) is g:
            del tel.by_uuid[g.uuid]
        g.uuid = u
        tel.by_uuid[u] = g


def _write_rows(
    session: Session,
    rows_flush: list[dict[str, Any]],
    perf_rows: list[dict[str, Any]],
    uuid_rows: list[dict[str, Any]],
    now: float,
) -> int:
    """Write the GPUs' aggregates, performance scores and UUIDs learned, one statement each.
    Returns the rows written."""
    writes = 0
    if rows_flush:
        _upsert(
            session,
            GpuTelemetry.__table__,
            rows_flush,
            ["gpu_id"],
            [c for c in rows_flush[0] if c != "gpu_id"],
        )
        writes += len(rows_flush)
    if perf_rows:
        t = Gpu.__table__
        session.connection().execute(
            update(t)
            .where(t.c.id == bindparam("g_id"))
            .values(perf=bindparam("g_perf"), perf_at=_dt(now)),
            perf_rows,
        )
        writes += len(perf_rows)
    if uuid_rows:
        t = Gpu.__table__
        session.connection().execute(
            update(t).where(t.c.id == bindparam("g_id")).values(uuid=bindparam("g_uuid")),
            uuid_rows,
        )
        writes += len(uuid_rows)
    return writes


def _send_signals(
    session: Session,
    tel: Telemetry,
    res: IngestResult,
    signals: dict[str, list[Signal]],
    now: float,
) -> int:
    """An outbox message per node for `health.evaluate` with the signals it raised. Returns
    the messages written."""
    writes = 0
    for host, ss in signals.items():
        node = tel.nodes.get(host)
        if node is None or not ss:
            continue
        enqueue(
            session,
            "health.evaluate",
            queue="health",
            node_id=str(node.node_id),
            # When it reached us (the server's clock): a repair begun since answers it.
            signals=[{**s.as_dict(), "received": now} for s in ss],
        )
        writes += 1
        res.signals += len(ss)
    return writes


def _reject(res: IngestResult, ref: Any, target: tuple | str, name: str, why: str) -> None:
    res.rejected += 1
    res.rejected_by_reason[why] = res.rejected_by_reason.get(why, 0) + 1
    if len(res.rejections) < MAX_PROBLEMS:
        # A malformed label is not sent back: the sample's reference says where it is.
        host, index, uuid_ = (None, None, None) if why == BAD_LABEL else target
        res.rejections.append(
            {"sample": ref, "node": host, "gpu": index, "uuid": uuid_, "field": name, "reason": why}
        )


def _when(ts: float | None, now: float) -> float:
    if ts is None or math.isnan(ts):
        return now
    return min(now, max(ts, now - MAX_SKEW_S))


def _event(g: GpuState, kind: int, key: str, value: float, at: float) -> Signal | None:
    """Update an event-like field; the signal it raises, if any."""
    if kind == XID:
        code = int(value)
        if code == g.xid:
            return None  # the gauge still shows the Xid already seen
        g.xid = code
        return Signal(g.index, "xid", code, value, at) if code else None
    if kind == RECOVERY:
        code = int(value)
        if code == g.recovery:
            return None
        g.recovery = code
        return Signal(g.index, "recovery_action", code, value, at) if code else None
    prev = g.counters.get(key)
    g.counters[key] = value
    if kind == FLAG:
        if value and not prev:
            return Signal(g.index, key, None, value, at)
        return None
    rule = SIGNALS.get(key)
    if prev is None or value < prev:
        g.windows.pop(key, None)  # first sight, or the counter was reset (driver reload)
        return None
    if rule is None:
        return None
    if rule.threshold <= 1.0:
        return Signal(g.index, key, None, value - prev, at) if value > prev else None
    start, base = g.windows.get(key, (at, prev))
    if at - start > RATE_WINDOW_S:
        start, base = at, prev
    if value - base >= rule.threshold:
        g.windows.pop(key, None)
        return Signal(g.index, key, None, value - base, at)
    g.windows[key] = (start, base)
    return None


def _aggregate(g: GpuState, now: float) -> Signal | None:
    """Fold this batch's gauges into the GPU's aggregates (reports under load only)."""
    util, clock, bits = g.util, g.clock, g.throttle
    if util is None or util < perf.LOAD_UTIL:
        return None
    g.samples += 1
    if clock is not None and g.nominal:
        g.clock_ratio = perf.ewma(g.clock_ratio, clock / g.nominal)
    if bits is not None:
        g.throttled = perf.ewma(g.throttled, 1.0 if bits & THROTTLED_BITS else 0.0)
        g.hw = perf.ewma(g.hw, 1.0 if bits & HW_SLOWDOWN_BITS else 0.0)
        rule = SIGNALS["hw_slowdown"]
        if g.hw >= rule.threshold and not g.hw_flagged:
            g.hw_flagged = True
            return Signal(g.index, "hw_slowdown", None, round(g.hw, 3), now)
        if g.hw < rule.threshold / 2:
            g.hw_flagged = False
    return None


def _telemetry_row(g: GpuState, now: float) -> dict[str, Any]:
    latest = dict(g.latest)
    for k, v in (("util", g.util), ("sm_clock", g.clock), ("throttle", g.throttle)):
        if v is not None:
            latest[k] = v
    return {
        "gpu_id": g.gpu_id,
        "updated_at": _dt(now),
        "last_xid": g.xid,
        "last_recovery_action": g.recovery,
        "counters": dict(g.counters),
        "latest": latest,
        "clock_ratio": g.clock_ratio,
        "throttled": g.throttled,
        "samples": g.samples,
    }


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _beat(session: Session, node_ids: list[uuid.UUID], now: float, timeout: float) -> None:
    """Write the nodes' heartbeats, and whether they have shown an agent (`NodeHeartbeat`): a
    report more than a heartbeat timeout after the one before starts a new stream; a stream of
    AGENT_BEATS heartbeats over AGENT_SPAN of the timeout is an agent's. Heartbeats are written
    at most every third of the timeout while a node is in the pool, so an agent pushing at any
    pace within the timeout shows itself within about two thirds of it; a single push, or a few
    within seconds (at every report while the node is out), does not."""
    t = NodeHeartbeat.__table__
    at = _dt(now)
    ins = dialect_insert(session, t)
    gap = t.c.last_seen_at < literal(_dt(now - timeout), t.c.last_seen_at.type)
    since = case(
        (gap, ins.excluded.last_seen_at),
        (t.c.stream_since.is_(None), t.c.last_seen_at),  # a row from before streams were kept
        else_=t.c.stream_since,
    )
    beats = case((gap, 1), else_=t.c.stream_beats + 1)
    shown = and_(
        beats >= AGENT_BEATS,
        since <= literal(_dt(now - AGENT_SPAN * timeout), t.c.last_seen_at.type),
    )
    stmt = ins.on_conflict_do_update(
        index_elements=["node_id"],
        set_={
            "last_seen_at": ins.excluded.last_seen_at,
            "stream_since": since,
            "stream_beats": beats,
            "agent": or_(t.c.agent, shown),
        },
    )
    rows = [
        {"node_id": n, "last_seen_at": at, "stream_since": at, "stream_beats": 1, "agent": False}
        for n in sorted(node_ids, key=str)  # one lock order for concurrent writers
    ]
    session.connection().execute(stmt, rows)


def _upsert(session: Session, table, rows: list[dict], keys: list[str], cols: list[str]) -> None:
    ins = dialect_insert(session, table)
    stmt = ins.on_conflict_do_update(
        index_elements=keys, set_={c: getattr(ins.excluded, c) for c in cols}
    )
    # Rows in key order: concurrent upserts of overlapping nodes lock in one order.
    rows.sort(key=lambda r: str(r[keys[0]]))
    session.connection().execute(stmt, rows)


def partition(session: Session, node_id: uuid.UUID, cut: bool) -> None:
    """Cut (or restore) the network between a node's agent and the control plane: while cut,
    its reports are dropped on arrival, as if they never came (chaos: node loss). Heartbeat
    detection then sees a silent node; nothing else is told."""
    row = session.get(NodeHeartbeat, node_id, with_for_update=True)
    if row is None:  # (no report: no stream; while cut off, it counts as having an agent)
        row = NodeHeartbeat(node_id=node_id, last_seen_at=utcnow(), partitioned=cut)
        session.add(row)
    else:
        row.partitioned = cut
    session.flush()
    tel = state_for(session)
    with tel.lock:
        for node in tel.nodes.values():
            if node.node_id == node_id:
                node.partitioned = cut


def agent_joined(session: Session, node_id: uuid.UUID) -> None:
    """A node agent with a credential reported the node's inventory: the node has an agent on
    the best evidence there is, so its silence from now on is a fault (no stream of heartbeats
    is waited for, as it is for pushes that may be an operator's or a test's)."""
    t = NodeHeartbeat.__table__
    now = utcnow()
    ins = dialect_insert(session, t)
    stmt = ins.on_conflict_do_update(
        index_elements=["node_id"],
        set_={"last_seen_at": ins.excluded.last_seen_at, "agent": True},
    )
    session.execute(
        stmt,
        {
            "node_id": node_id,
            "last_seen_at": now,
            "stream_since": now,
            "stream_beats": 1,
            "agent": True,
        },
    )


def ingest_from_node(session: Session, text: str, node: str) -> IngestResult:
    """A node agent's push (dcgm-exporter's text, or its own NVML samples rendered the same
    way): it speaks for its own node only. A sample labelled with another node's hostname is
    rejected (a bad label, never looked up); one naming its GPU by UUID alone is read as this
    node's (a UUID another node's GPU holds is then refused as a conflict). Every push is the
    node's heartbeat."""
    samples, targets = parse_exposition(text)
    for key, target in targets.items():
        if isinstance(target, str):
            continue
        host, gpu, uuid_ = target
        if host is None:
            targets[key] = (node, gpu, uuid_)
        elif host != node:
            targets[key] = BAD_LABEL
    return ingest(session, samples, targets, heartbeat_nodes=[node])
