"""A region as the placement core sees it, read from the database: its fleet (kept per process
while the region's fleet version holds), every live allocation, the workloads holding GPUs and
those waiting, and their tenants' quotas. A worker keeps the region's state between cycles and
brings it up to date from what changed since its last read."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime

from sqlalchemy import literal, or_, select, text
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.models.agents import AgentNode
from app.models.fleet import Gpu, Node, NodeState, Rack, Region, SoftwareStack
from app.models.health import PLACEABLE, Health
from app.models.workloads import Allocation, Workload
from app.models.workloads import TenantQuota as QuotaRow
from app.placement.isolation import Tier
from app.placement.mig import PROFILES
from app.placement.model import Level, Request, Shape, Topology
from app.placement.perf import decayed
from app.placement.queueing import (
    QueueConfig,
    Scheduler,
    TenantQuota,
)
from app.placement.queueing import (
    Workload as QWorkload,
)
from app.placement.snapshot import DEGRADED, FAILED, HEALTHY, NodeSpec, Snapshot
from app.scheduling.lifecycle import HOLDING, State
from app.tenancy.scoping import scoped_select

EPOCH = datetime(2026, 1, 1, tzinfo=utcnow().tzinfo)


# The placement core's view of a GPU's health: healthy; suspect (used last, never in a gang's
# fast class); anything else is out of the pool (quarantined, draining, repairing, validating,
# out of service).
_HEALTH = {Health.healthy.value: HEALTHY, Health.suspect.value: DEGRADED}


_NODE_PLACEABLE = frozenset(h.value for h in PLACEABLE)


def seconds(dt: datetime | None) -> float | None:
    """The core's clock (seconds since EPOCH); None stays None."""
    return None if dt is None else clock(dt)


def clock(dt: datetime) -> float:
    return (as_aware(dt) - EPOCH).total_seconds()


def request_of(w: Workload) -> Request:
    s = w.shape
    shape = Shape(
        gpus=s.gpus,
        mig=s.mig_profile,
        milli=s.milli,
        gpu_mem_mib=s.gpu_memory_mib,
        cpu_milli=s.cpu_milli,
        mem_mib=s.memory_mib,
        models=frozenset(s.gpu_models) or None,
    )
    topo = None
    if w.topology:
        topo = Topology(Level[w.topology["level"].upper()], w.topology["mode"] == "required")
    avoid = frozenset((n, int(g)) for n, g in w.avoid_gpus or ())
    return Request(
        str(w.id),
        str(w.tenant_id),
        Tier.parse(w.tier),
        shape,
        w.size,
        topo,
        avoid=avoid,
        stack=w.stack,
        min_cuda=w.min_cuda or 0,
        runtime=placed_runtime(w.runtime, w.tier, bool(w.ssh_keys), w.volumes),
    )


def placed_runtime(runtime: str, tier: str, ssh: bool, volumes: list | None = None) -> str:
    """What a workload needs of a node's agent, as `node_runtimes` names what one offers: with
    volumes, an agent that mounts them (`+volumes`), on shared storage if one is (`+shared`)."""
    if tier == Tier.CONFIDENTIAL_VM.label:
        need = "confidential-vm"
    elif runtime == "podman" and ssh:
        need = "podman-ssh"
    else:
        need = runtime
    if any(v.get("storage") == "shared" for v in volumes or []):
        return need + SHARED
    return need + VOLUMES if volumes else need


# Suffixes of what an agent offers: it mounts tenants' volumes (every agent that knows them;
# an older one would run the work without them), and the fleet's shared storage.
VOLUMES, SHARED = "+volumes", "+shared"


def node_runtimes(node: Node, process_pools: frozenset[str]) -> frozenset[str] | None:
    """The runtimes work may use on `node`: what its agent offers, `process` only in a pool the
    operator trusts with it (`*`: every pool); None for a node no agent runs (anything)."""
    return runtimes_offered(node.agent_offers, node.pool, process_pools)


def runtimes_offered(
    agent_offers: list[str] | None, pool: str | None, process_pools: frozenset[str]
) -> frozenset[str] | None:
    """`node_runtimes` of a node's columns."""
    if agent_offers is None:
        return None
    said = set(agent_offers)
    offers = said & {"process", "podman", "vm"}
    if "podman" in offers and "ssh" in said:
        offers.add("podman-ssh")  # its containers can be instances one logs into
    if "vm" in offers and said & {"sev-snp", "tdx"}:
        offers.add("confidential-vm")
    if "*" not in process_pools and (pool or "") not in process_pools:
        offers.discard("process")
    plain = frozenset(offers)
    if "volumes" in said:
        offers |= {o + VOLUMES for o in plain}
    if "shared-volumes" in said:  # its agent mounts the fleet's shared storage
        offers |= {o + SHARED for o in plain}
    return frozenset(offers)


def process_pools() -> frozenset[str]:
    return frozenset(p.strip() for p in get_settings().process_pools.split(",") if p.strip())


@dataclass
class World:
    snap: Snapshot
    node_ids: dict[str, uuid.UUID]  # node name -> id
    node_rack: dict[str, tuple[str, str]]  # node name -> (region, rack)
    node_model: dict[str, str]
    specs: list[NodeSpec] = field(default_factory=list)  # what `snap` was built from


# The fleet part of a region's snapshot changes rarely (imports, cordons, health, MIG mode),
# while every cycle needs it: kept per process and region, and used again while the region's
# fleet version (bumped by triggers in the transaction of any change to its racks, nodes or
# GPUs) holds. Reading 100 nodes of ORM objects cost ~30 ms a cycle; the version is one row.
_WORLDS: dict[tuple[str, str], tuple[tuple, World]] = {}  # (database, region) -> (version, fleet)


# The region's id and fleet version, and the oldest transaction still running (the xmin of this
# statement's snapshot): every transaction older than it has committed or aborted, so a change
# it has not seen has a `changed_xid` at least this.
_VERSION = text(
    "SELECT id, fleet_version, pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
    " FROM regions WHERE name = :region"
)


def _version(session: Session, region: str) -> tuple[tuple, int] | None:
    """((region id, fleet version), xmin), or None for a region that does not exist."""
    row = session.execute(_VERSION, {"region": region}).first()
    return None if row is None else ((row[0], row[1]), row[2])


def world_of(session: Session, region: str) -> World | None:
    """The region's fleet as a fresh snapshot (no allocations yet), from this process's copy
    when the fleet has not changed since it was read (PostgreSQL; SQLite reads every time)."""
    if session.get_bind().dialect.name != "postgresql":
        return read_world(session, region)
    got = _version(session, region)
    if got is None:
        return None
    version = got[0]
    key = (str(session.get_bind().engine.url), region)
    hit = _WORLDS.get(key)
    if hit is None or hit[0] != version:
        world = read_world(session, region)
        if world is None:
            return None
        hit = _WORLDS[key] = (version, world)
        return world
    w = hit[1]  # its snapshot went to the cycle that read it: each cycle gets a fresh one
    return World(Snapshot(w.specs), w.node_ids, w.node_rack, w.node_model, w.specs)


def read_world(session: Session, region: str) -> World | None:
    rows = session.execute(
        select(Node, Rack.name, Rack.block)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == region)
        .order_by(Node.name)
    ).all()
    stacks = dict(session.execute(select(SoftwareStack.id, SoftwareStack.name)).all())
    if not rows:
        return None
    # Nodes run by agents: their GPUs change MIG mode only by a relayout (app/agents/mig.py).
    agents = set(
        session.scalars(
            select(AgentNode.node_id).where(AgentNode.node_id.in_([n.id for n, _, _ in rows]))
        )
    )
    gpus: dict[uuid.UUID, list[Gpu]] = {}
    for g in session.scalars(
        select(Gpu).where(Gpu.node_id.in_([n.id for n, _, _ in rows])).order_by(Gpu.index)
    ):
        gpus.setdefault(g.node_id, []).append(g)
    specs = []
    now, tau = utcnow(), get_settings().perf_decay_seconds
    trusted = process_pools()
    for node, rack, block in rows:
        gs = gpus.get(node.id, [])
        specs.append(
            NodeSpec(
                node.name,
                node.gpu_model,
                len(gs),
                node.cpu_milli,
                node.memory_mib,
                region=region,
                rack=f"{region}/{rack}",
                block=f"{region}/{block}",
                domain=node.nvlink_domain,
                mig_gpus=tuple(g.index for g in gs if g.mig_mode),
                # An agent's MIG GPU with no instances reported has none to place on.
                mig_layouts=tuple(
                    (g.index, tuple((k, int(st)) for k, st in (g.mig_layout or [])))
                    for g in gs
                    if g.mig_mode and (g.mig_layout is not None or node.id in agents)
                ),
                fixed_mig=node.id in agents,
                schedulable=node.state == NodeState.ready.value and node.health in _NODE_PLACEABLE,
                # A GPU being laid out again is out, as a failed one is, until its agent reports.
                gpu_health=tuple(
                    FAILED if g.relayout_pending else _HEALTH.get(g.health, FAILED) for g in gs
                ),
                gpu_perf=_speeds(gs, now, tau) if any(g.perf < 1.0 for g in gs) else None,
                stack=stacks.get(node.stack_id) if node.stack_id else None,
                drifted=bool(node.drift),
                cuda=node.cuda_version or 0,
                runtimes=node_runtimes(node, trusted),
            )
        )
    return World(
        Snapshot(specs),
        {n.name: n.id for n, _, _ in rows},
        {n.name: (region, rack) for n, rack, _ in rows},
        {n.name: n.gpu_model for n, _, _ in rows},
        specs,
    )


def _speeds(gs: list[Gpu], now: datetime, tau: float) -> tuple[float, ...]:
    """Each GPU's measured speed, faded toward nominal since its evidence (app/placement/perf),
    in steps of 1 % (the kept fleet is reused while its version holds)."""
    out = []
    for g in gs:
        age = (now - as_aware(g.perf_at)).total_seconds() if g.perf_at else 0.0
        out.append(round(decayed(float(g.perf), age, tau), 2))
    return tuple(out)


def qworkload(w: Workload, alloc_ids: tuple[int, ...] = ()) -> QWorkload:
    """`w` as the core sees it, holding the snapshot allocations `alloc_ids`."""
    return QWorkload(
        str(w.id),
        request_of(w),
        w.priority,
        clock(w.created_at),
        float(w.max_runtime_s),
        checkpoint_cost=float(w.checkpoint_cost_s),
        alloc_ids=alloc_ids,
        checkpoint_every=float(w.checkpoint_interval_s) if w.checkpoint_interval_s else None,
        expedited=bool(w.expedited),
        **_moments(w.state, w.started_at, w.last_checkpoint_at, w.preempted_at),
    )


def _moments(state: str, started, checkpoint, preempted) -> dict[str, float | None]:
    """The parts of a workload the core sees that change while it holds GPUs."""
    return {
        # Only running work can be evicted; work on its way up or down is left alone.
        "started_at": seconds(started) if state == State.running.value else None,
        "last_checkpoint_at": seconds(checkpoint),
        "preempted_at": seconds(preempted),
    }


@dataclass
class _Held:
    """A workload holding GPUs, as a cycle needs it: its row version and its allocations."""

    state: str
    generation: int
    tenant_id: uuid.UUID
    qw: QWorkload  # alloc_ids: its allocations in the snapshot
    allocations: frozenset[uuid.UUID]  # their rows


@dataclass
class Loaded:
    """A region as the core sees it: the snapshot with every live allocation, the workloads
    holding GPUs and those waiting, and the quotas of their tenants."""

    world: World
    holding: dict[uuid.UUID, _Held]
    queued: list[Workload]
    quotas: dict[str, TenantQuota]

    def scheduler(self, config: QueueConfig | None = None) -> Scheduler:
        if config is None:
            settings = get_settings()
            config = QueueConfig(
                grace_period=settings.preemption_grace_seconds, share_cap=settings.fair_share_cap
            )
        return Scheduler(self.world.snap, self.quotas, config)

    def running(self) -> list[QWorkload]:
        return [h.qw for h in self.holding.values() if h.qw.alloc_ids]


def _quotas(session: Session, tenant_ids: set[uuid.UUID]) -> dict[str, TenantQuota]:
    quotas: dict[str, TenantQuota] = {}
    if not tenant_ids:
        return quotas
    for q in session.scalars(scoped_select(tenant_ids, QuotaRow)):
        cur = quotas.get(str(q.tenant_id)) or TenantQuota(guaranteed={}, limit={})
        lim = dict(cur.limit)
        if q.limit_milli is not None:
            lim[q.gpu_model] = q.limit_milli
        quotas[str(q.tenant_id)] = TenantQuota(
            dict(cur.guaranteed) | {q.gpu_model: q.guaranteed_milli}, lim, q.weight
        )
    return quotas


def _hold(
    session: Session, world: World, region: str, ids: list[uuid.UUID] | None = None
) -> dict[uuid.UUID, _Held]:
    """The region's workloads holding GPUs (or those of `ids` that still do), with their live
    allocations added to the world's snapshot. Rows are read before their allocations, so the
    allocations are at least as new as the generation kept: a change in between shows as a
    newer generation at the next diff."""
    snap = world.snap
    where = [Workload.state.in_([s.value for s in HOLDING])]
    where.append(Workload.region == region if ids is None else Workload.id.in_(ids))
    rows = {w.id: w for w in session.scalars(select(Workload).where(*where))}
    if not rows:
        return {}
    node_name = {v: k for k, v in world.node_ids.items()}
    aids: dict[uuid.UUID, list[int]] = {}
    rows_of: dict[uuid.UUID, set[uuid.UUID]] = {}
    for a in session.scalars(
        select(Allocation).where(
            Allocation.released_at.is_(None), Allocation.workload_id.in_(list(rows))
        )
    ):
        name = node_name.get(a.node_id)
        if name is None:  # a node since moved out of the region: its fleet version has moved
            continue
        mig = PROFILES[a.mig_profile] if a.mig_profile else None
        aid = snap.allocate(
            snap.tenant_id(str(a.tenant_id)),
            Tier.parse(a.tier),
            snap.node_index[name],
            tuple(a.gpu_indices),
            milli=0 if (mig or a.milli == 1000) else a.milli,
            gpu_mem=a.gpu_memory_mib,
            cpu=a.cpu_milli,
            mem=a.memory_mib,
            mig=mig,
            mig_start=a.mig_start,
        )
        aids.setdefault(a.workload_id, []).append(aid)
        rows_of.setdefault(a.workload_id, set()).add(a.id)
    return {
        wid: _Held(
            w.state,
            w.generation,
            w.tenant_id,
            qworkload(w, tuple(aids.get(wid, ()))),
            frozenset(rows_of.get(wid, ())),
        )
        for wid, w in rows.items()
    }


@dataclass
class _Region:
    """A region's state kept by a worker process between cycles: the fleet version it was built
    under, the snapshot with every live allocation, the workloads holding them, and the
    watermark of the last read (changes since come from transactions at or above it)."""

    version: tuple
    world: World
    holding: dict[uuid.UUID, _Held]
    watermark: int


# Per process and region. Each cycle brings it up to date from the workloads of the region
# written since its last read (`changed_xid` at or above the watermark, through the (region,
# changed_xid) index): allocations only ever change in the same transaction as their
# workload's state (placing, release on termination, eviction or failed provisioning), which
# bumps its generation. Workloads that stopped holding give their allocations back to the
# snapshot; new ones, and those whose allocations changed, are read in full. The cost follows
# what changed, not what runs. A fleet change (version) rebuilds everything.
_STATES: dict[tuple[str, str], _Region] = {}


def _diff(session: Session, region: str, state: _Region) -> None:
    snap = state.world.snap
    holding = {s.value for s in HOLDING}
    rows = session.execute(
        select(
            Workload.id,
            Workload.state,
            Workload.generation,
            Workload.started_at,
            Workload.last_checkpoint_at,
            Workload.preempted_at,
        ).where(Workload.region == region, Workload.changed_xid >= state.watermark)
    ).all()

    def drop(wid: uuid.UUID) -> None:
        for aid in state.holding.pop(wid).qw.alloc_ids:
            snap.release(aid)

    # A row comes back until the watermark passes its transaction: most are unchanged.
    moved = [r for r in rows if r[0] in state.holding and r[2] != state.holding[r[0]].generation]
    fresh = [r[0] for r in rows if r[1] in holding and r[0] not in state.holding]
    for r in rows:
        if r[1] not in holding and r[0] in state.holding:
            drop(r[0])
    # Most changes are a state moving on (placing, provisioning, running) with the same
    # allocations: those only update the moments the core sees; the rest are read in full.
    if moved:
        live: dict[uuid.UUID, set[uuid.UUID]] = {r[0]: set() for r in moved}
        for wid, aid in session.execute(
            select(Allocation.workload_id, Allocation.id).where(
                Allocation.workload_id.in_(list(live)), Allocation.released_at.is_(None)
            )
        ):
            live[wid].add(aid)
        for wid, st, gen, started, checkpoint, preempted in moved:
            if st not in holding:
                continue  # dropped above
            h = state.holding[wid]
            if live[wid] != h.allocations:
                drop(wid)
                fresh.append(wid)
                continue
            h.state, h.generation = st, gen
            h.qw = replace(h.qw, **_moments(st, started, checkpoint, preempted))
    if fresh:
        state.holding.update(_hold(session, state.world, region, fresh))
    snap.commit()


def _region_state(session: Session, region: str) -> _Region | None:
    """The region's kept state, up to date (PostgreSQL only: it needs the triggers)."""
    got = _version(session, region)
    if got is None:
        return None
    version, xmin = got
    key = (str(session.get_bind().engine.url), region)
    state = _STATES.get(key)
    try:
        if state is None or state.version != version:
            _STATES.pop(key, None)
            world = read_world(session, region)
            if world is None:
                return None
            state = _Region(version, world, _hold(session, world, region), xmin)
            world.snap.commit()
        else:
            _diff(session, region, state)
            state.watermark = xmin
    except BaseException:
        _STATES.pop(key, None)  # half brought up to date: start afresh next time
        raise
    _STATES[key] = state
    return state


# The state as a literal, not a parameter: psycopg prepares a statement after a few runs, and
# PostgreSQL's generic plan for `state = $1` cannot use the partial queue index (state =
# 'queued'), so it read the region's every workload instead (seen in a bench).
IS_QUEUED = Workload.state == literal(State.queued.value, literal_execute=True)


def load(
    session: Session,
    region: str,
    extra_tenant: uuid.UUID | None = None,
    *,
    kept: bool = False,
) -> Loaded | None:
    """The region for one cycle. `kept`: from this process's kept state, brought up to date
    (the caller must leave its snapshot as it found it); else read in full, on a fresh
    snapshot."""
    if kept and session.get_bind().dialect.name == "postgresql":
        state = _region_state(session, region)
        if state is None:
            return None
        world, holding = state.world, state.holding
    else:
        fresh = world_of(session, region)
        if fresh is None:
            return None
        world, holding = fresh, _hold(session, fresh, region)
        world.snap.commit()
    # Not those backing off after a restart (their back-off's end sends a cycle), nor those
    # held back (their dependencies, their array's limit: app/workloads/holds.py).
    queued = list(
        session.scalars(
            select(Workload)
            .where(
                Workload.region == region,
                IS_QUEUED,
                Workload.hold.is_(None),
                or_(Workload.not_before.is_(None), Workload.not_before <= utcnow()),
            )
            .order_by(Workload.created_at)
        )
    )
    tenants = {h.tenant_id for h in holding.values()} | {w.tenant_id for w in queued}
    if extra_tenant is not None:
        tenants.add(extra_tenant)
    return Loaded(world, holding, queued, _quotas(session, tenants))
