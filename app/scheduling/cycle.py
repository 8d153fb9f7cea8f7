"""The I/O edge of placement: a region's snapshot from the database, one scheduling cycle of the
pure core (`app.placement.queueing`), and the plan applied in the same transaction.

Safety, in layers:
- one decider per region at a time: a transaction-scoped advisory lock (PostgreSQL; the
  embedded SQLite has one writer anyway), so different regions run in parallel;
- every workload the plan touches is re-read `FOR UPDATE` and must still have the state and
  generation the snapshot saw, else the whole plan is dropped and the cycle runs again;
- the database itself refuses double allocation: `gpu_usage` CHECKs (a GPU never holds more than
  1000 milli or its memory) and a partial unique index on live MIG slice claims.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from sqlalchemy import bindparam, literal, select, text, update
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.core.config import get_settings
from app.core.db import as_aware, dialect_insert, insert_objects, new_id, utcnow
from app.core.logging import get_logger
from app.metering import service as metering
from app.models.fleet import Gpu, Node, NodeState, Rack, Region
from app.models.health import PLACEABLE, Health
from app.models.metering import UsageKind
from app.models.workloads import Allocation, GpuUsage, MigClaim, Workload
from app.models.workloads import TenantQuota as QuotaRow
from app.outbox.service import enqueue
from app.placement.catalog import GPU_MODELS
from app.placement.isolation import Tier
from app.placement.mig import MEMORY_SLICES, PROFILES, profile_name
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
from app.scheduling import lifecycle
from app.scheduling.lifecycle import HOLDING, State

log = get_logger(__name__)

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


class PlanConflict(Exception):
    """A workload changed between the snapshot and the apply: drop the plan, run again."""


@dataclass
class CycleReport:
    region: str
    ran: bool  # False: another worker holds the region's lock
    admitted: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)


def region_lock_key(region: str) -> int:
    """The advisory lock key (a signed bigint) of a region's placement decisions."""
    key = int.from_bytes(hashlib.blake2b(f"placement:{region}".encode(), digest_size=8).digest())
    return key - (1 << 63)


def lock_region(session: Session, region: str) -> bool:
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(
        session.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": region_lock_key(region)})
    )


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
        str(w.id), str(w.tenant_id), Tier.parse(w.tier), shape, w.replicas, topo, avoid=avoid
    )


@dataclass
class _World:
    snap: Snapshot
    node_ids: dict[str, uuid.UUID]  # node name -> id
    node_rack: dict[str, tuple[str, str]]  # node name -> (region, rack)
    node_model: dict[str, str]
    specs: list[NodeSpec] = field(default_factory=list)  # what `snap` was built from


# The fleet part of a region's snapshot changes rarely (imports, cordons, health, MIG mode),
# while every cycle needs it: kept per process and region, and used again while the region's
# fleet version (bumped by triggers in the transaction of any change to its racks, nodes or
# GPUs) holds. Reading 100 nodes of ORM objects cost ~30 ms a cycle; the version is one row.
_WORLDS: dict[tuple[str, str], tuple[tuple, _World]] = {}  # (database, region) -> (version, fleet)

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


def _world(session: Session, region: str) -> _World | None:
    """The region's fleet as a fresh snapshot (no allocations yet), from this process's copy
    when the fleet has not changed since it was read (PostgreSQL; SQLite reads every time)."""
    if session.get_bind().dialect.name != "postgresql":
        return _read_world(session, region)
    got = _version(session, region)
    if got is None:
        return None
    version = got[0]
    key = (str(session.get_bind().engine.url), region)
    hit = _WORLDS.get(key)
    if hit is None or hit[0] != version:
        world = _read_world(session, region)
        if world is None:
            return None
        hit = _WORLDS[key] = (version, world)
        return world
    w = hit[1]  # its snapshot went to the cycle that read it: each cycle gets a fresh one
    return _World(Snapshot(w.specs), w.node_ids, w.node_rack, w.node_model, w.specs)


def _read_world(session: Session, region: str) -> _World | None:
    rows = session.execute(
        select(Node, Rack.name, Rack.block)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == region)
        .order_by(Node.name)
    ).all()
    if not rows:
        return None
    gpus: dict[uuid.UUID, list[Gpu]] = {}
    for g in session.scalars(
        select(Gpu).where(Gpu.node_id.in_([n.id for n, _, _ in rows])).order_by(Gpu.index)
    ):
        gpus.setdefault(g.node_id, []).append(g)
    specs = []
    now, tau = utcnow(), get_settings().perf_decay_seconds
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
                schedulable=node.state == NodeState.ready.value and node.health in _NODE_PLACEABLE,
                gpu_health=tuple(_HEALTH.get(g.health, FAILED) for g in gs),
                gpu_perf=_speeds(gs, now, tau) if any(g.perf < 1.0 for g in gs) else None,
            )
        )
    return _World(
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
class _Loaded:
    """A region as the core sees it: the snapshot with every live allocation, the workloads
    holding GPUs and those waiting, and the quotas of their tenants."""

    world: _World
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
    for q in session.scalars(select(QuotaRow).where(QuotaRow.tenant_id.in_(list(tenant_ids)))):
        cur = quotas.get(str(q.tenant_id)) or TenantQuota(guaranteed={}, limit={})
        lim = dict(cur.limit)
        if q.limit_milli is not None:
            lim[q.gpu_model] = q.limit_milli
        quotas[str(q.tenant_id)] = TenantQuota(
            dict(cur.guaranteed) | {q.gpu_model: q.guaranteed_milli}, lim, q.weight
        )
    return quotas


def _hold(
    session: Session, world: _World, region: str, ids: list[uuid.UUID] | None = None
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
    world: _World
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
            world = _read_world(session, region)
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


def _load(
    session: Session,
    region: str,
    extra_tenant: uuid.UUID | None = None,
    *,
    kept: bool = False,
) -> _Loaded | None:
    """The region for one cycle. `kept`: from this process's kept state, brought up to date
    (the caller must leave its snapshot as it found it); else read in full, on a fresh
    snapshot."""
    if kept and session.get_bind().dialect.name == "postgresql":
        state = _region_state(session, region)
        if state is None:
            return None
        world, holding = state.world, state.holding
    else:
        fresh = _world(session, region)
        if fresh is None:
            return None
        world, holding = fresh, _hold(session, fresh, region)
        world.snap.commit()
    queued = list(
        session.scalars(
            select(Workload)
            .where(Workload.region == region, IS_QUEUED)
            .order_by(Workload.created_at)
        )
    )
    tenants = {h.tenant_id for h in holding.values()} | {w.tenant_id for w in queued}
    if extra_tenant is not None:
        tenants.add(extra_tenant)
    return _Loaded(world, holding, queued, _quotas(session, tenants))


def run_cycle(session: Session, region: str, config: QueueConfig | None = None) -> CycleReport:
    """One placement cycle for `region`, applied in the caller's transaction (which the caller
    commits). Raises PlanConflict if a workload changed under it (roll back and run again)."""
    waiting = session.scalar(
        select(Workload.id).where(Workload.region == region, IS_QUEUED).limit(1)
    )
    if waiting is None:  # nothing to decide: skip the snapshot
        return CycleReport(region, ran=True)
    if not lock_region(session, region):
        return CycleReport(region, ran=False)
    now = utcnow()
    loaded = _load(session, region, kept=True)
    if loaded is None:  # no nodes (left): its work waits for capacity to be registered
        return CycleReport(region, ran=True)
    snap = loaded.world.snap
    mark = snap.checkpoint()
    try:
        return _decide_and_apply(session, region, loaded, now, config)
    finally:
        # The kept snapshot goes back to what the database held before this cycle: what the
        # cycle wrote (if it commits) comes back through the next cycle's diff.
        snap.rollback(mark)


def _decide_and_apply(
    session: Session, region: str, loaded: _Loaded, now: datetime, config: QueueConfig | None
) -> CycleReport:
    world, snap = loaded.world, loaded.world.snap
    queued = loaded.queued
    seen = {wid: (h.state, h.generation) for wid, h in loaded.holding.items()}
    seen |= {w.id: (w.state, w.generation) for w in queued}
    report = CycleReport(region, ran=True)
    if not queued:
        return report
    result = loaded.scheduler(config).cycle(
        clock(now), [qworkload(w) for w in queued], loaded.running()
    )
    report.blocked = dict(result.blocked)

    # Every workload the plan touches, re-read FOR UPDATE in one statement: each must still be
    # as the snapshot saw it, or the plan is dropped.
    touched = [ev.workload for ev in result.evictions] + [a.workload for a in result.admissions]
    rows: dict[str, Workload] = {}
    if touched:
        for w in session.scalars(
            select(Workload)
            .where(Workload.id.in_([uuid.UUID(t) for t in touched]))
            .with_for_update()
            .execution_options(populate_existing=True)  # the rows as committed, not as read
        ):
            rows[str(w.id)] = w

    def locked(wid: str) -> Workload:
        w = rows.get(wid)
        if w is None or (w.state, w.generation) != seen[w.id]:
            raise PlanConflict(f"workload {wid} changed during the cycle")
        return w

    preempted: list[tuple] = []  # audit entries: the system preempted these
    for ev in result.evictions:
        w = locked(ev.workload)
        deadline = now + timedelta(seconds=ev.deadline - clock(now))
        w.evicted_at, w.stop_deadline = now, deadline
        # Another tenant's workload is named only to operators (the audit log), not here.
        by = rows.get(ev.by)
        own, others = (
            disclose(w.tenant_id, [(ev.by, by.tenant_id, by.priority)])
            if by is not None
            else ([], [])
        )
        whom = (
            f"workload {own[0]}"
            if own
            else f"a {by.priority} workload of another tenant"
            if by is not None
            else "other work"
        )
        lifecycle.transition(
            session,
            w,
            State.checkpointing,
            f"preempted ({ev.reason}) for {whom}: checkpoint before {deadline:%H:%M:%S}",
            {
                "reason": ev.reason,
                "by": own[0] if own else None,
                "by_others": others,
                "deadline": deadline.isoformat(),
                "lost_gpu_seconds": round(ev.lost_gpu_seconds, 1),
            },
            at=now,
        )
        preempted.append(
            (
                w.tenant_id,
                "workload",
                w.id,
                {"reason": ev.reason, "by": own[0] if own else None, "by_others": others},
                {"by": ev.by, "by_tenant": str(by.tenant_id) if by is not None else None},
            )
        )
        # Its GPUs are promised to `by`, which starts after the grace.
        release(session, w, now, reason="preempted")
        enqueue(
            session,
            "workloads.finish_preemption",
            queue="provisioning",
            workload_id=str(w.id),
            countdown=max(0.0, (deadline - now).total_seconds()),
        )
        report.evicted.append(ev.workload)
    audit.record_system(session, "workload.preempt", preempted)
    for reconf in result.reconfigurations:
        session.execute(
            update(Gpu)
            .where(Gpu.node_id == world.node_ids[reconf.node], Gpu.index == reconf.gpu_index)
            .values(mig_mode=reconf.mig_mode)
        )
    started: list[dict] = []  # usage ledger: each new allocation starts metering
    new_allocs: list[tuple[Allocation, str]] = []
    provision: dict[float, list[str]] = {}  # countdown -> workloads to provision
    moved: list[Workload] = []
    stamp = utcnow()  # after the snapshot was read: later than the release of anything it saw
    for adm in result.admissions:
        w = locked(adm.workload)
        placement = []
        for b in adm.bindings:
            a = snap.allocs[b.alloc_id]
            model = world.node_model[b.node]
            milli = PROFILES[a.mig].gpu_equivalent_milli if a.mig else (a.milli or 1000)
            row = Allocation(
                id=new_id(),
                workload_id=w.id,
                tenant_id=w.tenant_id,
                node_id=world.node_ids[b.node],
                replica=b.replica,
                tier=w.tier,
                gpu_indices=list(b.gpu_indices),
                mig_profile=a.mig,
                mig_start=a.mig_start,
                milli=milli,
                gpu_memory_mib=a.gpu_mem,
                cpu_milli=a.cpu,
                memory_mib=a.mem,
                created_at=stamp,
            )
            new_allocs.append((row, model))
            placement.append(describe(world, b))
            started.append(
                metering.allocation_event(
                    UsageKind.start,
                    row,
                    region=world.node_rack[b.node][0],
                    gpu_model=model,
                    priority=w.priority,
                    at=stamp,
                )
            )
        w.placement = placement
        own, others = disclose(
            w.tenant_id, [(v, rows[v].tenant_id, rows[v].priority) for v in adm.victims]
        )
        victims = ", ".join([*own, *([_others(others)] if others else [])])
        lifecycle.transition(
            session,
            w,
            State.placing,
            f"placed by the {adm.phase} phase"
            + (f", after preempting {victims}" if victims else ""),
            {
                "phase": adm.phase,
                "borrowed": adm.borrowed,
                "victims": own,
                "victims_others": others,
            },
            at=now,
            flush=False,
        )
        delay = round(max(0.0, adm.start_at - clock(now)), 1)
        provision.setdefault(delay, []).append(str(w.id))
        report.admitted.append(adm.workload)
        moved.append(w)
    lifecycle.write(session, moved)  # before anything autoflushes them one by one
    insert_objects(session, [row for row, _ in new_allocs])
    claim(session, new_allocs)
    for delay, ids in provision.items():  # one message per start time, not one per workload
        enqueue(
            session, "workloads.provision", queue="provisioning", countdown=delay, workload_ids=ids
        )
    metering.ingest(session, started)
    return report


def describe(world: _World, b) -> dict:
    """One replica's placement as the API shows it."""
    reg, rack = world.node_rack[b.node]
    per_gpu = PROFILES[b.mig_profile].gpu_equivalent_milli if b.mig_profile else (b.milli or 1000)
    return {
        "replica": b.replica,
        "region": reg,
        "rack": rack,
        "node": b.node,
        "gpu_indices": list(b.gpu_indices),
        "gpu_model": world.node_model[b.node],
        # The model's name for the slice ("3g.40gb"), as requests, capacity and prices say it.
        "mig_profile": profile_name(world.node_model[b.node], b.mig_profile)
        if b.mig_profile
        else None,
        "mig_slot": b.mig_start,
        "milli": b.milli or None,
        "gpu_milli": per_gpu * len(b.gpu_indices),
    }


def disclose(
    viewer: uuid.UUID, workloads: list[tuple[str, uuid.UUID, str]]
) -> tuple[list[str], list[dict]]:
    """What a tenant may know of workloads (id, tenant, priority) its own work touches: the ids
    of its own, and of other tenants' only how many of each priority."""
    own = [wid for wid, tenant, _ in workloads if tenant == viewer]
    counts: dict[str, int] = {}
    for _, tenant, priority in workloads:
        if tenant != viewer:
            counts[priority] = counts.get(priority, 0) + 1
    return own, [{"priority": p, "count": n} for p, n in sorted(counts.items())]


def _others(summary: list[dict]) -> str:
    return ", ".join(
        f"{c['count']} {c['priority']} workload{'s' if c['count'] > 1 else ''} of another tenant"
        for c in summary
    )


@dataclass
class DryRun:
    placeable_now: bool
    placement: list[dict]
    preempts: list[str]  # the asking tenant's own
    preempts_others: list[dict]  # other tenants': how many of each priority
    expected_start: datetime | None
    reason: str


def dry_run(session: Session, w: Workload) -> DryRun:
    """What the next cycle would do with `w` (not stored) if it were at the head of its queue:
    where it lands now, whom it preempts, or when it is expected to start. Reads only."""
    loaded = _load(session, w.region or "", extra_tenant=w.tenant_id)
    if loaded is None:
        return DryRun(False, [], [], [], None, "the region has no nodes")
    now = utcnow()
    ans = loaded.scheduler().what_if(
        qworkload(w), clock(now), [qworkload(x) for x in loaded.queued], loaded.running()
    )
    start = None
    if ans.expected_start is not None:
        start = EPOCH + timedelta(seconds=ans.expected_start)
    held = {str(wid): h for wid, h in loaded.holding.items()}
    own, others = disclose(
        w.tenant_id,
        [(v, held[v].tenant_id, held[v].qw.priority) for v in ans.preempts if v in held],
    )
    return DryRun(
        ans.placeable_now,
        [describe(loaded.world, b) for b in ans.bindings],
        own,
        others,
        start,
        ans.reason,
    )


def claim(session: Session, allocs: list[tuple[Allocation, str]], sign: int = 1) -> None:
    """Add (or, with sign -1, remove) allocations, each with its GPU model, to the per-GPU
    usage rows, in one upsert for all their GPUs, and (adding) write their MIG claims. The
    CHECKs and the unique index turn any double allocation into an IntegrityError."""
    delta: dict[tuple[uuid.UUID, int], list[int]] = {}  # (node, gpu) -> [milli, memory, cap]
    claims = []
    for a, model in allocs:
        cap = GPU_MODELS[model].memory_mib if model in GPU_MODELS else 0
        if a.mig_profile:
            mem = cap * PROFILES[a.mig_profile].memory // MEMORY_SLICES
        elif a.milli < 1000:
            mem = a.gpu_memory_mib
        else:
            mem = cap
        for g in a.gpu_indices:
            d = delta.setdefault((a.node_id, g), [0, 0, cap])
            d[0] += sign * a.milli
            d[1] += sign * mem
        if a.mig_profile and sign > 0:
            assert a.mig_start is not None
            claims += [
                MigClaim(allocation_id=a.id, node_id=a.node_id, gpu_index=a.gpu_indices[0], slice=s)
                for s in range(a.mig_start, a.mig_start + PROFILES[a.mig_profile].memory)
            ]
    if delta and sign > 0:  # rows may not exist yet: insert or add, one executemany
        # (a multi-row VALUES statement would be compiled afresh on every call)
        stmt = dialect_insert(session, GpuUsage)
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=[GpuUsage.node_id, GpuUsage.gpu_index],
                set_={
                    "milli_used": GpuUsage.milli_used + stmt.excluded.milli_used,
                    "memory_used_mib": GpuUsage.memory_used_mib + stmt.excluded.memory_used_mib,
                },
            ),
            [
                {
                    "node_id": node,
                    "gpu_index": g,
                    "milli_used": milli,
                    "memory_mib": cap,
                    "memory_used_mib": mem,
                }
                for (node, g), (milli, mem, cap) in sorted(delta.items())  # one lock order
            ],
        )
    elif delta:  # the rows exist (the CHECKs would refuse a negative insert): one batch
        session.connection().execute(
            update(GpuUsage.__table__)
            .where(
                GpuUsage.__table__.c.node_id == bindparam("n"),
                GpuUsage.__table__.c.gpu_index == bindparam("g"),
            )
            .values(
                milli_used=GpuUsage.__table__.c.milli_used + bindparam("dm"),
                memory_used_mib=GpuUsage.__table__.c.memory_used_mib + bindparam("dmem"),
            ),
            [
                {"n": node, "g": g, "dm": milli, "dmem": mem}
                for (node, g), (milli, mem, _) in sorted(delta.items())
            ],
        )
    insert_objects(session, claims)
    session.flush()


def unstopped_holders(
    session: Session, ws: list[Workload]
) -> dict[uuid.UUID, dict[uuid.UUID, datetime | None]]:
    """The invariant no provider call may break: nothing starts on a GPU before every earlier
    holder of that GPU has stopped. An evicted holder gives its allocations up at once (they are
    promised to its preemptor) but runs on through its grace period until it is stopped (or
    ends by itself): what counts is its state in the database, never its deadline, which a lost
    stop (a worker killed during the grace) would leave behind. For each of `ws` (about to be
    provisioned) that would start too soon: the evicted workloads still checkpointing whose
    released allocations share one of its GPUs, with their stop deadlines."""
    if not ws:
        return {}
    mine = session.execute(
        select(Allocation.workload_id, Allocation.node_id, Allocation.gpu_indices).where(
            Allocation.workload_id.in_([w.id for w in ws]), Allocation.released_at.is_(None)
        )
    ).all()
    if not mine:
        return {}
    held: dict[tuple[uuid.UUID, int], dict[uuid.UUID, datetime | None]] = {}
    for victim, node, gpus, deadline in session.execute(
        select(
            Allocation.workload_id,
            Allocation.node_id,
            Allocation.gpu_indices,
            Workload.stop_deadline,
        )
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(
            Workload.state == State.checkpointing.value,  # not stopped yet: few rows, indexed
            Allocation.node_id.in_({node for _, node, _ in mine}),
            Allocation.released_at >= Workload.evicted_at,  # what it held until its eviction
        )
    ):
        for g in gpus:
            held.setdefault((node, g), {})[victim] = deadline
    out: dict[uuid.UUID, dict[uuid.UUID, datetime | None]] = {}
    for wid, node, gpus in mine:
        for g in gpus:
            if (node, g) in held:
                out.setdefault(wid, {}).update(held[(node, g)])
    return out


def waiting_for(session: Session, w: Workload) -> list[uuid.UUID]:
    """The workloads placed (still `placing`) on GPUs that `w` held until its eviction: those
    whose start waits for `w` to stop."""
    if w.evicted_at is None:
        return []
    gave = session.execute(
        select(Allocation.node_id, Allocation.gpu_indices).where(
            Allocation.workload_id == w.id, Allocation.released_at >= w.evicted_at
        )
    ).all()
    if not gave:
        return []
    gpus = {(node, g) for node, indices in gave for g in indices}
    rows = session.execute(
        select(Allocation.workload_id, Allocation.node_id, Allocation.gpu_indices)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(
            Workload.state == State.placing.value,
            Allocation.node_id.in_({node for node, _ in gave}),
            Allocation.released_at.is_(None),
        )
    )
    return sorted({wid for wid, node, indices in rows if any((node, g) in gpus for g in indices)})


def stopped(session: Session, w: Workload) -> None:
    """`w`, evicted, has just stopped (in the caller's transaction): its GPUs are free, so the
    workloads waiting to start on them are provisioned now, not at its deadline."""
    ids = waiting_for(session, w)
    if ids:
        enqueue(
            session,
            "workloads.provision",
            queue="provisioning",
            workload_ids=[str(i) for i in ids],
        )


def release(
    session: Session, w: Workload, at: datetime | None = None, reason: str | None = None
) -> int:
    """End `w`'s live allocations (GPU usage and MIG claims go with them) and stop their
    metering, in the caller's transaction."""
    at = at or utcnow()
    rows = list(
        session.scalars(
            select(Allocation)
            .where(Allocation.workload_id == w.id, Allocation.released_at.is_(None))
            .with_for_update()
        )
    )
    where = {
        nid: (model, region)
        for nid, model, region in session.execute(
            select(Node.id, Node.gpu_model, Region.name)
            .join(Rack, Node.rack_id == Rack.id)
            .join(Region, Rack.region_id == Region.id)
            .where(Node.id.in_([a.node_id for a in rows]))
        )
    }
    stopped = []
    for a in rows:
        a.released_at = at
        model, region = where[a.node_id]
        stopped.append(
            metering.allocation_event(
                UsageKind.stop,
                a,
                region=region,
                gpu_model=model,
                priority=w.priority,
                at=at,
                reason=reason,
            )
        )
    # Only MIG allocations hold claims; Core, not the ORM's bulk UPDATE (which evaluates the
    # session's objects for every statement: 6 % of a DELETE's CPU for whole-GPU work).
    mig = [a.id for a in rows if a.mig_profile]
    if mig:
        t = MigClaim.__table__
        session.execute(
            update(t)
            .where(t.c.allocation_id.in_(mig), t.c.released_at.is_(None))
            .values(released_at=at)
        )
    claim(session, [(a, where[a.node_id][0]) for a in rows], sign=-1)
    metering.ingest(session, stopped)
    return len(rows)
