"""Telemetry in: DCGM samples from node agents, as JSON or as dcgm-exporter's Prometheus text.

What is kept is what the health logic needs, per process and in memory: each GPU's counters'
last values (deltas are taken against them), the last Xid and recovery action seen, latest
gauges, and exponentially weighted aggregates for the performance score. The database gets:
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

Nothing is taken on trust: a sample outside its field's domain (`DOMAINS`: an Xid of -1, a
negative counter, Inf, a temperature of 5000 C), stamped more than MAX_SKEW_S ahead of the
server's clock, with a malformed label, or claiming the UUID of another GPU is rejected on its
own (counted, with its reason, never acted on) and the rest of the batch still applies. A UUID
resolves only to the GPU whose record holds it, or to nothing.
"""

from __future__ import annotations

import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.parser import parse_labels
from sqlalchemy import and_, bindparam, case, event, literal, or_, select, update
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import dialect_insert, utcnow
from app.core.errors import ValidationFailed
from app.health.actions import HW_SLOWDOWN_BITS, SIGNALS, THROTTLED_BITS
from app.health.metrics import TELEMETRY_REJECTED
from app.health.schemas import HOST_PATTERN, UUID_PATTERN
from app.models.fleet import Gpu, Node
from app.models.health import GpuTelemetry, NodeHeartbeat
from app.outbox.service import enqueue
from app.placement import perf
from app.placement.catalog import GPU_MODELS

# What each DCGM field is to the health loop (anything else is counted and ignored).
XID, RECOVERY, COUNTER, FLAG, THROTTLE, UTIL, CLOCK, GAUGE = range(8)
FIELDS: dict[str, tuple[int, str]] = {
    "DCGM_FI_DEV_XID_ERRORS": (XID, "xid"),
    "DCGM_FI_DEV_GPU_RECOVERY_ACTION": (RECOVERY, "recovery_action"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (COUNTER, "ecc_dbe"),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": (COUNTER, "ecc_sbe"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (COUNTER, "uncorrectable_remapped_rows"),
    "DCGM_FI_DEV_RETIRED_DBE": (COUNTER, "retired_dbe"),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": (COUNTER, "nvlink_crc_flit"),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": (COUNTER, "nvlink_replay"),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": (COUNTER, "nvlink_recovery"),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": (COUNTER, "pcie_replay"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": (FLAG, "row_remap_failure"),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": (THROTTLE, "throttle"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": (THROTTLE, "throttle"),  # the newer name, same field
    "DCGM_FI_DEV_GPU_UTIL": (UTIL, "util"),
    "DCGM_FI_DEV_SM_CLOCK": (CLOCK, "sm_clock"),
    "DCGM_FI_DEV_GPU_TEMP": (GAUGE, "gpu_temp"),
    "DCGM_FI_DEV_MEMORY_TEMP": (GAUGE, "memory_temp"),
    "DCGM_FI_DEV_POWER_USAGE": (GAUGE, "power_w"),
    "DCGM_FI_DEV_FB_USED": (GAUGE, "fb_used_mib"),
}
# What each field's value may be: (lowest, highest, whole numbers only). Outside it, a sample is
# rejected. DCGM marks a value it has not got (blank, not found, not supported, no permission)
# with the top of its type's range: 0x7ffffff0 and up (int32 fields), 0x7ffffffffffffff0 and up
# (int64 fields); those are never a reading either. NaN is a gauge's "no reading" (taken in,
# nothing learned) and no value at all for an event-like field; Inf is never a value.
INT32_BLANK = 0x7FFFFFF0
INT64_BLANK = 0x7FFFFFFFFFFFFFF0
_COUNT = (0.0, float(INT64_BLANK - 1), True)
DOMAINS: dict[str, tuple[float, float, bool]] = {
    "xid": (0.0, float(INT32_BLANK - 1), True),  # 0: no Xid; NVIDIA's codes are small
    "recovery_action": (0.0, float(INT32_BLANK - 1), True),  # 0: none (NVML's values: 0-4)
    "ecc_dbe": _COUNT,
    "ecc_sbe": _COUNT,
    "uncorrectable_remapped_rows": _COUNT,
    "retired_dbe": _COUNT,
    "nvlink_crc_flit": _COUNT,
    "nvlink_replay": _COUNT,
    "nvlink_recovery": _COUNT,
    "pcie_replay": _COUNT,
    "row_remap_failure": (0.0, 1.0, True),  # a flag
    "throttle": _COUNT,  # bit flags
    "util": (0.0, 100.0, False),  # %
    "sm_clock": (0.0, 10_000.0, False),  # MHz
    "gpu_temp": (-50.0, 200.0, False),  # C
    "memory_temp": (-50.0, 200.0, False),
    "power_w": (0.0, 10_000.0, False),  # W (a GB200 superchip draws under 3 kW)
    "fb_used_mib": (0.0, float(1 << 24), False),  # MiB (16 TiB)
}
_NAN_IS_NO_READING = frozenset({UTIL, CLOCK, GAUGE})
# Why a sample is rejected (each counted in the answer and on /metrics).
OUT_OF_RANGE = "out_of_range"  # outside its field's domain (or not a whole number where one is)
NOT_FINITE = "not_finite"  # Inf, or NaN where a reading cannot be missing
FUTURE_TIMESTAMP = "future_timestamp"  # stamped more than MAX_SKEW_S ahead of the server
BAD_LABEL = "bad_label"  # a control character in a label, or a malformed Hostname, gpu or UUID
UUID_CONFLICT = "uuid_conflict"  # a UUID another GPU's record holds, or on another node
_REJECTED_TARGETS = frozenset({BAD_LABEL, UUID_CONFLICT})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HOST = re.compile(HOST_PATTERN)
_UUID = re.compile(UUID_PATTERN)
_INDEX = re.compile(r"[0-9]|[1-5][0-9]|6[0-3]")  # as the fleet numbers GPUs: 0..63
_MIN_MS, _MAX_MS = -(1 << 63), (1 << 63) - 1  # a sample's timestamp: int64 milliseconds
# Counters whose signal is a rate (a rise of `threshold` within RATE_WINDOW_S), not any rise.
RATE_WINDOW_S = 60.0
# A sample's own timestamp is trusted within this much of the server's clock (agents' clocks
# drift): a fault is dated by it, and so is the end of the usage it interrupts. One stamped
# further ahead is rejected.
MAX_SKEW_S = 120.0
# Node names not in the fleet are not looked up again for this long.
MISSING_TTL_S = 30.0
# A process re-reads a node's GPU ids this often (a fleet import may have replaced them).
RELOAD_S = 600.0
PARTITIONED = "partitioned"  # a target whose node's reports are cut off (chaos: node loss)
MAX_PROBLEMS = 100
# A node has an agent (its silence is a fault) once its reports came as a stream of this many
# heartbeats over this share of the heartbeat timeout (see `_beat`).
AGENT_BEATS = 3
AGENT_SPAN = 2 / 3
_IN_POOL = frozenset({"healthy", "suspect"})


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


class GpuState:
    __slots__ = (
        "gpu_id",
        "host",
        "index",
        "uuid",
        "nominal",
        "xid",
        "recovery",
        "counters",
        "windows",
        "latest",
        "util",
        "clock",
        "throttle",
        "clock_ratio",
        "throttled",
        "hw",
        "hw_flagged",
        "samples",
        "perf",
        "flushed_at",
        "seen",
        "ts",
    )

    def __init__(
        self, gpu_id: uuid.UUID, host: str, index: int, model: str, uuid_: str | None
    ) -> None:
        self.gpu_id = gpu_id
        self.host = host
        self.index = index
        self.uuid = uuid_
        m = GPU_MODELS.get(model)
        self.nominal: float | None = float(m.sm_clock_mhz) if m and m.sm_clock_mhz else None
        self.xid = 0
        self.recovery = 0
        self.counters: dict[str, float] = {}
        self.windows: dict[str, tuple[float, float]] = {}  # rate counters: (start, value then)
        self.latest: dict[str, float] = {}
        self.util: float | None = None
        self.clock: float | None = None
        self.throttle: int | None = None
        self.clock_ratio: float | None = None
        self.throttled: float | None = None
        self.hw = 0.0
        self.hw_flagged = False
        self.samples = 0
        self.perf = 1.0
        self.flushed_at = 0.0
        self.seen = 0  # the batch that last touched it
        self.ts = 0.0  # the latest sample's time (the agent's clock, else arrival)


class NodeState:
    __slots__ = (
        "node_id",
        "name",
        "gpus",
        "written_at",
        "beat_ts",
        "loaded_at",
        "ts",
        "out",
        "partitioned",
    )

    def __init__(self, node_id: uuid.UUID, name: str, loaded_at: float):
        self.node_id = node_id
        self.name = name
        self.gpus: dict[str, GpuState] = {}  # by index, as a string (dcgm-exporter's label)
        self.written_at = 0.0  # heartbeat last written (epoch s, the server's clock)
        self.beat_ts = 0.0  # `ts` when it was (the agent's clock)
        self.loaded_at = loaded_at
        self.ts = 0.0  # the latest sample's time (the agent's clock, else arrival)
        # Out of the pool (being repaired, unreachable...): its heartbeats are written at
        # every report, since they say when it came back.
        self.out = False
        self.partitioned = False  # its reports are dropped (see NodeHeartbeat.partitioned)


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


class Telemetry:
    """This process's view of the fleet's telemetry (see the module)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.by_uuid: dict[str, GpuState] = {}
        self.missing: dict[str, float] = {}
        self.lock = threading.Lock()
        self.batch = 0
        self.db: str | None = None

    def forget(self, names: set[str]) -> None:
        with self.lock:
            for name in names:
                node = self.nodes.pop(name, None)
                if node is not None:
                    self._unmap(node)

    def _unmap(self, node: NodeState) -> None:
        """Drop the UUIDs that name this node's GPUs (the node is forgotten or read again)."""
        for g in node.gpus.values():
            if g.uuid and self.by_uuid.get(g.uuid) is g:
                del self.by_uuid[g.uuid]

    def holder(self, uuid_: str) -> GpuState | None:
        """The GPU whose record holds `uuid_`, as this process last read or wrote it; None if
        unknown here (an entry left by a node read again since is dropped)."""
        g = self.by_uuid.get(uuid_)
        if g is None:
            return None
        node = self.nodes.get(g.host)
        if g.uuid != uuid_ or node is None or node.gpus.get(str(g.index)) is not g:
            del self.by_uuid[uuid_]
            return None
        return g

    # --- reading what the database knows -------------------------------------------------------

    def _load(self, session: Session, names: set[str], now: float) -> None:
        rows = session.execute(
            select(
                Node.id,
                Node.name,
                Node.health,
                Gpu.id,
                Gpu.index,
                Gpu.model,
                Gpu.uuid,
                Gpu.perf,
                GpuTelemetry,
                NodeHeartbeat.last_seen_at,
                NodeHeartbeat.partitioned,
            )
            .join(Gpu, Gpu.node_id == Node.id)
            .outerjoin(GpuTelemetry, GpuTelemetry.gpu_id == Gpu.id)
            .outerjoin(NodeHeartbeat, NodeHeartbeat.node_id == Node.id)
            .where(Node.name.in_(sorted(names)))
        ).all()
        for name in names:
            if name in self.nodes:
                self._unmap(self.nodes[name])  # the records say again which UUID is whose
        fresh: dict[str, NodeState] = {}
        for node_id, name, health, gpu_id, index, model, uuid_, perf_, tel, seen, cut in rows:
            node = fresh.get(name)
            if node is None:
                node = fresh[name] = NodeState(node_id, name, now)
                # The server's clock until the agent's is known (see `ingest`'s heartbeats).
                node.written_at = node.beat_ts = seen.timestamp() if seen else 0.0
                node.out = health not in _IN_POOL
                node.partitioned = bool(cut)
            old = self.nodes.get(name)
            kept = old.gpus.get(str(index)) if old is not None else None
            if kept is not None and kept.gpu_id == gpu_id:
                g = kept  # same GPU: keep what this process measured
                g.uuid = uuid_  # ... but its UUID is the record's (another process may learn it)
            else:
                g = GpuState(gpu_id, name, index, model, uuid_)
                g.perf = float(perf_)
                if tel is not None:
                    g.xid, g.recovery = tel.last_xid, tel.last_recovery_action
                    g.counters = dict(tel.counters or {})
                    g.latest = dict(tel.latest or {})
                    g.clock_ratio, g.throttled, g.samples = (
                        tel.clock_ratio,
                        tel.throttled,
                        tel.samples,
                    )
                    g.flushed_at = tel.updated_at.timestamp()
            node.gpus[str(index)] = g
            if uuid_:
                self.by_uuid[uuid_] = g
        for name in names:
            if name in fresh:
                self.nodes[name] = fresh[name]
                self.missing.pop(name, None)
            else:
                self.nodes.pop(name, None)
                self.missing[name] = now + MISSING_TTL_S

    def _hosts_of_uuids(self, session: Session, uuids: set[str]) -> set[str]:
        return set(
            session.scalars(
                select(Node.name).join(Gpu, Gpu.node_id == Node.id).where(Gpu.uuid.in_(uuids))
            )
        )

    def resolve(
        self, session: Session, targets: dict[Any, tuple[str | None, str | None, str | None] | str]
    ) -> dict[Any, GpuState | str]:
        """Each target (hostname, GPU index, UUID) -> its GPU's state, or what is wrong: a
        target's labels are checked before anything is looked up (BAD_LABEL), a UUID names the
        GPU whose record holds it or nothing, and a target naming a GPU by its node and index
        with the UUID of another GPU is refused (UUID_CONFLICT), its UUID not learned."""
        now = time.time()
        need: set[str] = set()
        uuids: set[str] = set()
        cached: set[str] = set()
        out: dict[Any, GpuState | str] = {}
        good: dict[Any, tuple[str | None, str | None, str | None]] = {}
        for key, target in targets.items():
            if isinstance(target, str) or not _well_formed(*target):
                out[key] = BAD_LABEL  # never looked up: its text does not reach the database
            else:
                good[key] = target

        def read(host: str) -> None:
            node = self.nodes.get(host)
            if node is not None and now - node.loaded_at <= RELOAD_S:
                cached.add(host)
            elif not self.missing.get(host, 0.0) > now:
                need.add(host)

        for host, _index, uuid_ in good.values():
            if host is not None:
                read(host)
            elif uuid_ is not None:
                g = self.holder(uuid_)
                if g is None:
                    uuids.add(uuid_)
                else:
                    read(g.host)  # checked as any other node (replaced, cut off)
        if cached:
            # One indexed read per batch: a node replaced under the same name (a fleet
            # re-import) is read again rather than written to under its old id.
            ids: dict[str, uuid.UUID] = {}
            for name, nid, health, cut in session.execute(
                select(Node.name, Node.id, Node.health, NodeHeartbeat.partitioned)
                .outerjoin(NodeHeartbeat, NodeHeartbeat.node_id == Node.id)
                .where(Node.name.in_(sorted(cached)))
            ):
                ids[name] = nid
                self.nodes[name].out = health not in _IN_POOL
                self.nodes[name].partitioned = bool(cut)
            need |= {h for h in cached if ids.get(h) != self.nodes[h].node_id}
        if uuids:
            need |= self._hosts_of_uuids(session, uuids)
        if need:
            self._load(session, need, now)
        claims: dict[str, list[tuple[Any, GpuState]]] = {}
        for key, (host, index, uuid_) in good.items():
            if host is None:
                g = self.holder(uuid_) if uuid_ else None
                cut = g is not None and self.nodes[g.host].partitioned
                out[key] = PARTITIONED if cut else g if g is not None else "unknown_gpu"
                continue
            node = self.nodes.get(host)
            if node is None:
                out[key] = "unknown_node"
                continue
            if node.partitioned:
                out[key] = PARTITIONED
                continue
            g = node.gpus.get(index) if index is not None else None
            if g is None and uuid_:
                g = self.holder(uuid_)
                if g is not None and g.host != host:
                    out[key] = UUID_CONFLICT  # the UUID is another node's GPU's
                    continue
            elif g is not None and uuid_ and uuid_ != g.uuid:
                claims.setdefault(uuid_, []).append((key, g))  # to learn, if no GPU holds it
            out[key] = g if g is not None else "unknown_gpu"
        if claims:
            # The records decide (another process may have learned a UUID since this one read
            # it); of GPUs in this batch claiming a UUID no record holds, the first takes it.
            held = dict(
                session.execute(select(Gpu.uuid, Gpu.id).where(Gpu.uuid.in_(sorted(claims)))).all()
            )
            for uuid_, claimants in claims.items():
                owner = held.get(uuid_, claimants[0][1].gpu_id)
                for key, g in claimants:
                    if g.gpu_id != owner:
                        out[key] = UUID_CONFLICT
        return out


def _well_formed(host: str | None, index: str | None, uuid_: str | None) -> bool:
    """Whether a target's labels can name a fleet GPU (the REST schema's patterns)."""
    return (
        (host is None or _HOST.fullmatch(host) is not None)
        and (index is None or _INDEX.fullmatch(index) is not None)
        and (uuid_ is None or len(uuid_) <= 64 and _UUID.fullmatch(uuid_) is not None)
    )


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


# --- parsing -------------------------------------------------------------------------------------


def parse_exposition(text: str) -> tuple[list[tuple], dict[str, tuple | str]]:
    """dcgm-exporter's Prometheus text -> (samples, targets): samples as (line number, label
    text, metric name, value, timestamp in epoch seconds or None), targets as label text ->
    (Hostname, gpu, UUID), or BAD_LABEL for a set with a control character (its samples are
    rejected). The label sets are parsed by prometheus-client's parser, once per distinct set:
    dcgm-exporter repeats each GPU's set once per field. Raises ValidationFailed naming the
    first malformed line."""
    samples: list[tuple] = []
    targets: dict[str, tuple | str] = {}
    append = samples.append
    lineno = 0
    for line in text.split("\n"):
        lineno += 1
        if not line or line[0] == "#" or line.isspace():
            continue
        try:
            brace = line.find("{")
            if brace >= 0:
                close = line.rindex("}")
                name = line[:brace]
                labels = line[brace + 1 : close]
                rest = line[close + 1 :].split()
                if labels not in targets:
                    parsed = parse_labels(labels, False)
                    targets[labels] = (
                        BAD_LABEL
                        if _CONTROL.search(labels)
                        else (parsed.get("Hostname"), parsed.get("gpu"), parsed.get("UUID"))
                    )
            else:
                parts = line.split()
                name, rest, labels = parts[0], parts[1:], ""
                targets.setdefault("", (None, None, None))
            if not 1 <= len(rest) <= 2 or not name.isidentifier() and ":" not in name:
                raise ValueError("expected: name{labels} value [timestamp]")
            value = float(rest[0])
            ts = None
            if len(rest) == 2:
                ms = int(rest[1])
                if not _MIN_MS <= ms <= _MAX_MS:
                    raise ValueError("the timestamp is not a 64-bit integer (milliseconds)")
                ts = ms / 1000.0
        except ValueError as exc:
            raise ValidationFailed(
                f"Line {lineno} is not a Prometheus sample: {exc}.",
                code="malformed_sample",
                line=lineno,
                sample=line[:200],
            ) from None
        append((lineno, labels, name, value, ts))
    return samples, targets


# --- the pass over a batch -------------------------------------------------------------------


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
    horizon = now + MAX_SKEW_S
    with tel.lock:
        if heartbeat_nodes:
            for host in heartbeat_nodes:
                targets[("node", host)] = (host, None, None)
        resolved = tel.resolve(session, targets)
        tel.batch += 1
        batch = tel.batch
        touched: list[GpuState] = []
        nodes: dict[str, NodeState] = {}
        signals: dict[str, list[Signal]] = {}
        learned: list[tuple[GpuState, str]] = []
        raised: list[GpuState] = []
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
                if g in _REJECTED_TARGETS:
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
                why = _invalid(kind, value)
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
        # Aggregates, once per GPU per batch.
        flush: list[GpuState] = []
        perf_moves: list[GpuState] = []
        every = settings.telemetry_flush_seconds
        for g in touched:
            owner = tel.nodes.get(g.host)
            if owner is not None and g.ts > owner.ts:
                owner.ts = g.ts
            s = _aggregate(g, now)
            if s is not None:
                signals.setdefault(g.host, []).append(s)
                raised.append(g)
            score = perf.from_telemetry(
                g.clock_ratio, g.throttled, g.samples, g.nominal is not None
            )
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
        for g in raised:
            if id(g) not in in_flush:
                in_flush.add(id(g))
                flush.append(g)
        for g in flush:
            g.flushed_at = max(g.ts, g.flushed_at)
        # A heartbeat says when the server last heard from the node: it is written at most every
        # `beat_every` of the server's clock, or of the node's samples' (a replay faster than
        # real time writes as many as the fleet would). Neither clock is compared with the
        # other, so no stamp an agent sends can hold its heartbeats back.
        beat_every = settings.heartbeat_timeout_seconds / 3
        beats = []
        for node in nodes.values():
            if (
                node.out
                or now - node.written_at >= beat_every
                or node.ts - node.beat_ts >= beat_every
            ):
                node.written_at, node.beat_ts = now, node.ts
                beats.append(node)
        res.nodes = len(nodes)
        rows_flush = [_telemetry_row(g, now) for g in flush]
        perf_rows = [{"g_id": g.gpu_id, "g_perf": g.perf} for g in perf_moves]
        uuid_rows = [{"g_id": g.gpu_id, "g_uuid": u} for g, u in learned]
        for g, u in learned:
            if g.uuid and tel.by_uuid.get(g.uuid) is g:
                del tel.by_uuid[g.uuid]
            g.uuid = u
            tel.by_uuid[u] = g
    for why, n in res.rejected_by_reason.items():
        TELEMETRY_REJECTED.labels(why).inc(n)
    # What this process now believes of these nodes is undone if the transaction rolls back
    # (`_forget_signalled`): told before the writes, any of which may fail.
    touched_hosts = set(signals) | {g.host for g, _u in learned}
    if touched_hosts:
        session.info.setdefault(_TOUCHED, set()).update(touched_hosts)
    # The writes, outside the lock: one statement each.
    writes = 0
    if beats:
        _beat(session, [n.node_id for n in beats], now, settings.heartbeat_timeout_seconds)
        writes += len(beats)
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
    if signals:
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
    res.db_writes = writes
    return res


def _invalid(kind: int, value: float) -> str | None:
    """Why a value outside its field's domain (`DOMAINS`) is rejected; None for NaN where it is
    a gauge's "no reading"."""
    if value != value:
        return None if kind in _NAN_IS_NO_READING else NOT_FINITE
    if value in (math.inf, -math.inf):
        return NOT_FINITE
    return OUT_OF_RANGE


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
