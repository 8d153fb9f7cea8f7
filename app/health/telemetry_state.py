"""This process's view of the fleet's telemetry: per node and GPU, what the health logic needs
between reports (counters' last values, the last Xid and recovery action seen, latest gauges,
the performance aggregates), read from the database the first time a process sees a node and
again every RELOAD_S; and the resolution of a sample's target (hostname, GPU index, UUID) to
the GPU it names, or to what is wrong with it."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.health.dcgm import BAD_LABEL, UUID_CONFLICT, well_formed
from app.models.fleet import Gpu, Node
from app.models.health import GpuTelemetry, NodeHeartbeat
from app.placement.catalog import GPU_MODELS

# Node names not in the fleet are not looked up again for this long.
MISSING_TTL_S = 30.0
# A process re-reads a node's GPU ids this often (a fleet import may have replaced them).
RELOAD_S = 600.0
PARTITIONED = "partitioned"  # a target whose node's reports are cut off (chaos: node loss)
_IN_POOL = frozenset({"healthy", "suspect"})


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
        out: dict[Any, GpuState | str] = {}
        good: dict[Any, tuple[str | None, str | None, str | None]] = {}
        for key, target in targets.items():
            if isinstance(target, str) or not well_formed(*target):
                out[key] = BAD_LABEL  # never looked up: its text does not reach the database
            else:
                good[key] = target
        need = self._to_read(session, good, now)
        if need:
            self._load(session, need, now)
        claims: dict[str, list[tuple[Any, GpuState]]] = {}
        for key, (host, index, uuid_) in good.items():
            out[key] = self._answer(key, host, index, uuid_, claims)
        if claims:
            self._settle_claims(session, claims, out)
        return out

    def _to_read(
        self,
        session: Session,
        good: dict[Any, tuple[str | None, str | None, str | None]],
        now: float,
    ) -> set[str]:
        """The nodes the targets name that must be read (again) from the database."""
        need: set[str] = set()
        uuids: set[str] = set()
        cached: set[str] = set()

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
            need |= self._replaced(session, cached)
        if uuids:
            need |= self._hosts_of_uuids(session, uuids)
        return need

    def _replaced(self, session: Session, cached: set[str]) -> set[str]:
        """Of the nodes read before, those replaced under their name; the rest's flags refreshed."""
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
        return {h for h in cached if ids.get(h) != self.nodes[h].node_id}

    def _answer(
        self,
        key: Any,
        host: str | None,
        index: str | None,
        uuid_: str | None,
        claims: dict[str, list[tuple[Any, GpuState]]],
    ) -> GpuState | str:
        """One well-formed target's GPU, or what is wrong; a UUID it would teach, in `claims`."""
        if host is None:
            g = self.holder(uuid_) if uuid_ else None
            cut = g is not None and self.nodes[g.host].partitioned
            return PARTITIONED if cut else g if g is not None else "unknown_gpu"
        node = self.nodes.get(host)
        if node is None:
            return "unknown_node"
        if node.partitioned:
            return PARTITIONED
        g = node.gpus.get(index) if index is not None else None
        if g is None and uuid_:
            g = self.holder(uuid_)
            if g is not None and g.host != host:
                return UUID_CONFLICT  # the UUID is another node's GPU's
        elif g is not None and uuid_ and uuid_ != g.uuid:
            claims.setdefault(uuid_, []).append((key, g))  # to learn, if no GPU holds it
        return g if g is not None else "unknown_gpu"

    def _settle_claims(
        self,
        session: Session,
        claims: dict[str, list[tuple[Any, GpuState]]],
        out: dict[Any, GpuState | str],
    ) -> None:
        """UUID_CONFLICT for each GPU claiming a UUID that another GPU holds or claimed first."""
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
