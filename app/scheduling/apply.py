"""A cycle's plan applied in the cycle's transaction, and the allocation accounting every
writer of allocations shares.

- every workload the plan touches is re-read `FOR UPDATE` and must still have the state and
  generation the snapshot saw, else the whole plan is dropped (`PlanConflict`);
- evictions move their victims to `checkpointing` with a deadline; admissions write their
  allocations, claim their GPUs and start metering;
- the database itself refuses double allocation: `gpu_usage` CHECKs (a GPU never holds more than
  1000 milli or its memory) and a partial unique index on live MIG slice claims."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.core.config import get_settings
from app.core.db import as_aware, dialect_insert, insert_objects, new_id, utcnow
from app.metering import service as metering
from app.models.agents import AgentNode
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.metering import UsageKind
from app.models.workloads import Allocation, GpuUsage, MigClaim, Workload
from app.outbox.service import enqueue
from app.placement.catalog import GPU_MODELS
from app.placement.mig import MEMORY_SLICES, PROFILES, profile_name
from app.placement.queueing import (
    Admission,
    CycleResult,
    Eviction,
    QueueConfig,
)
from app.scheduling import lifecycle
from app.scheduling.lifecycle import State
from app.scheduling.providers import AgentProvider
from app.scheduling.world import Loaded, World, clock, qworkload


class PlanConflict(Exception):
    """A workload changed between the snapshot and the apply: drop the plan, run again."""


@dataclass
class CycleReport:
    region: str
    ran: bool  # False: another worker holds the region's lock
    admitted: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)


def apply_plan(
    session: Session, region: str, loaded: Loaded, now: datetime, config: QueueConfig | None
) -> CycleReport:
    """One cycle of the core over `loaded`, its plan applied in the caller's transaction."""
    report = CycleReport(region, ran=True)
    if not loaded.queued:
        return report
    result = loaded.scheduler(config).cycle(
        clock(now), [qworkload(w) for w in loaded.queued], loaded.running()
    )
    report.blocked = dict(result.blocked)
    touched = _Touched.lock(session, loaded, result)
    report.evicted = _evict(session, touched, result.evictions, now)
    for reconf in result.reconfigurations:
        session.execute(
            update(Gpu)
            .where(Gpu.node_id == loaded.world.node_ids[reconf.node], Gpu.index == reconf.gpu_index)
            .values(mig_mode=reconf.mig_mode)
        )
    report.admitted = _admit(session, loaded.world, touched, result.admissions, now)
    return report


@dataclass
class _Touched:
    """Every workload the plan touches, re-read FOR UPDATE in one statement, and the state and
    generation the snapshot saw of each: each must still be so, or the plan is dropped."""

    rows: dict[str, Workload]
    seen: dict[uuid.UUID, tuple[str, int]]

    @classmethod
    def lock(cls, session: Session, loaded: Loaded, result: CycleResult) -> _Touched:
        seen = {wid: (h.state, h.generation) for wid, h in loaded.holding.items()}
        seen |= {w.id: (w.state, w.generation) for w in loaded.queued}
        ids = [ev.workload for ev in result.evictions] + [a.workload for a in result.admissions]
        rows: dict[str, Workload] = {}
        if ids:
            for w in session.scalars(
                select(Workload)
                .where(Workload.id.in_([uuid.UUID(t) for t in ids]))
                .with_for_update()
                .execution_options(populate_existing=True)  # the rows as committed, not as read
            ):
                rows[str(w.id)] = w
        return cls(rows, seen)

    def locked(self, wid: str) -> Workload:
        w = self.rows.get(wid)
        if w is None or (w.state, w.generation) != self.seen[w.id]:
            raise PlanConflict(f"workload {wid} changed during the cycle")
        return w


def _evict(
    session: Session, touched: _Touched, evictions: list[Eviction], now: datetime
) -> list[str]:
    """Each victim checkpoints before its deadline, its GPUs promised to the workload that
    preempts it; the system's preemptions go to the audit log in one entry each."""
    evicted: list[str] = []
    preempted: list[tuple] = []  # audit entries: the system preempted these
    for ev in evictions:
        w = touched.locked(ev.workload)
        deadline = now + timedelta(seconds=ev.deadline - clock(now))
        w.evicted_at, w.stop_deadline = now, deadline
        # Another tenant's workload is named only to operators (the audit log), not here.
        by = touched.rows.get(ev.by)
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
        evicted.append(ev.workload)
    audit.record_system(session, "workload.preempt", preempted)
    return evicted


def _allocation_rows(
    world: World, w: Workload, adm: Admission, stamp: datetime
) -> list[tuple[Allocation, str]]:
    """The allocation rows of an admission's bindings, each with its node's GPU model."""
    out = []
    for b in adm.bindings:
        a = world.snap.allocs[b.alloc_id]
        milli = PROFILES[a.mig].gpu_equivalent_milli if a.mig else (a.milli or 1000)
        row = Allocation(
            id=new_id(),
            workload_id=w.id,
            tenant_id=w.tenant_id,
            node_id=world.node_ids[b.node],
            replica=b.replica,
            attempt=w.attempts,
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
        out.append((row, world.node_model[b.node]))
    return out


def _admit(
    session: Session,
    world: World,
    touched: _Touched,
    admissions: list[Admission],
    now: datetime,
) -> list[str]:
    """Each admitted workload gets its allocations (claimed on their GPUs, metered from now)
    and moves to `placing`; one provisioning message per start time."""
    admitted: list[str] = []
    started: list[dict] = []  # usage ledger: each new allocation starts metering
    new_allocs: list[tuple[Allocation, str]] = []
    provision: dict[float, list[str]] = {}  # countdown -> workloads to provision
    moved: list[Workload] = []
    now_startable: list[Workload] = []  # nothing to wait for: no start time, no victims
    gangs: list[tuple[Workload, uuid.UUID]] = []  # (gang, its replica 0's node)
    stamp = utcnow()  # after the snapshot was read: later than the release of anything it saw
    for adm in admissions:
        w = touched.locked(adm.workload)
        w.attempts = (w.attempts or 0) + 1  # a new run: its agents start it afresh
        w.ssh_host = w.ssh_port = w.ssh_ready_at = None  # the new run's agent reports its own
        w.serve_host = w.serve_port = w.serve_ready_at = None
        rows = _allocation_rows(world, w, adm, stamp)
        new_allocs += rows
        started += [
            metering.allocation_event(
                UsageKind.start,
                row,
                region=world.node_rack[b.node][0],
                gpu_model=model,
                priority=w.priority,
                at=stamp,
            )
            for b, (row, model) in zip(adm.bindings, rows, strict=True)
        ]
        w.placement = [describe(world, b) for b in adm.bindings]
        if w.replicas > 1:
            gangs.append((w, next(row.node_id for row, _ in rows if row.replica == 0)))
        victims = [(v, touched.rows[v].tenant_id, touched.rows[v].priority) for v in adm.victims]
        own, others = disclose(w.tenant_id, victims)
        named = ", ".join([*own, *([_others(others)] if others else [])])
        lifecycle.transition(
            session,
            w,
            State.placing,
            f"placed by the {adm.phase} phase" + (f", after preempting {named}" if named else ""),
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
        admitted.append(adm.workload)
        moved.append(w)
        if delay == 0 and not adm.victims:
            now_startable.append(w)
    give_master_ports(session, gangs, get_settings().master_ports)
    lifecycle.write(session, moved)  # before anything autoflushes them one by one
    insert_objects(session, [row for row, _ in new_allocs])
    claim(session, new_allocs)
    _start_agent_runs(session, now_startable, now)
    for delay, ids in provision.items():  # one message per start time, not one per workload
        enqueue(
            session, "workloads.provision", queue="provisioning", countdown=delay, workload_ids=ids
        )
    metering.ingest(session, started)
    return admitted


def give_master_ports(
    session: Session, gangs: list[tuple[Workload, uuid.UUID]], ports: str
) -> None:
    """Each newly placed gang's rendezvous port (`MASTER_PORT`), in `ports` (FIRST-LAST): one
    no other gang whose replica 0 is on the same node holds, live or stopping in its grace (two
    gangs' rank 0s on one host never share a port, as torchrun's fixed 29500 would). The
    search starts at a point drawn from the workload and attempt, so a new attempt does not
    wait for its last one's port to be let go."""
    if not gangs:
        return
    first, last = (int(p) for p in ports.split("-"))
    span = max(1, last - first + 1)
    held: dict[uuid.UUID, set[int]] = {}
    rows = session.execute(
        select(Allocation.node_id, Workload.master_port)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(
            Allocation.replica == 0,
            Allocation.node_id.in_({node for _, node in gangs}),
            Workload.master_port.is_not(None),
            or_(Allocation.released_at.is_(None), Allocation.released_at >= Workload.evicted_at),
        )
    )
    for node, port in rows:
        held.setdefault(node, set()).add(port)
    for w, node in gangs:
        taken = held.setdefault(node, set())
        if w.master_port is not None:
            taken.add(w.master_port)  # its last attempt's, maybe not let go yet
        start = first_port(w.id, w.attempts, span)
        free = (first + (start + i) % span for i in range(span))
        w.master_port = next((p for p in free if p not in taken), first + start)
        taken.add(w.master_port)


def first_port(workload_id: uuid.UUID, attempt: int, span: int) -> int:
    """Where a gang attempt's search for a free rendezvous port starts (0 <= it < span)."""
    digest = hashlib.blake2b(f"{workload_id}:{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % span


def describe(world: World, b) -> dict:
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


AGENT = AgentProvider.name


def _start_agent_runs(session: Session, ws: list[Workload], now: datetime) -> None:
    """Agent-run workloads that may start at once are `provisioning` in the placement's own
    transaction: their nodes' agents learn of them at its commit, instead of when a worker takes
    up the provisioning message (queued behind the worker's other tasks: seconds under load),
    which then only schedules the check of their start."""
    if not ws:
        return
    with session.no_autoflush:
        names = sorted({p["node"] for w in ws for p in w.placement or []})
        agent_run = set(
            session.scalars(select(AgentNode.node_name).where(AgentNode.node_name.in_(names)))
        )
        ws = [w for w in ws if any(p["node"] in agent_run for p in w.placement or [])]
        waiting = unstopped_holders(session, ws)
    ws = [w for w in ws if w.id not in waiting]
    for w in ws:
        lifecycle.transition(
            session, w, State.provisioning, f"provisioning ({AGENT})", at=now, flush=False
        )
    lifecycle.write(session, ws)


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


def release_unstarted(session: Session, w: Workload, reason: str) -> int:
    """End the allocations of `w`, placed but not yet running as a whole (it failed to start,
    or its node went before it did): each that never started when it began, so nothing of a
    run that never ran is billed; a replica whose process did start (a gang's first replicas)
    when its process ended, or now."""
    now = utcnow()

    def ends(a: Allocation) -> datetime:
        if a.run_started_at is None or a.run_state == "failed_to_start":
            return as_aware(a.created_at)
        return min(as_aware(a.run_ended_at), now) if a.run_ended_at is not None else now

    return release(session, w, reason=reason, at_of=ends)


def release(
    session: Session,
    w: Workload,
    at: datetime | None = None,
    reason: str | None = None,
    *,
    at_of: Callable[[Allocation], datetime] | None = None,
) -> int:
    """End `w`'s live allocations (GPU usage and MIG claims go with them) and stop their
    metering, in the caller's transaction: at `at` (default now), or each when `at_of` says."""
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
        a.released_at = ends = at_of(a) if at_of is not None else at
        model, region = where[a.node_id]
        stopped.append(
            metering.allocation_event(
                UsageKind.stop,
                a,
                region=region,
                gpu_model=model,
                priority=w.priority,
                at=ends,
                reason=reason,
            )
        )
    # Only MIG allocations hold claims; Core, not the ORM's bulk UPDATE (which evaluates the
    # session's objects for every statement: 6 % of a DELETE's CPU for whole-GPU work).
    mig: dict[datetime, list[uuid.UUID]] = {}
    for a in rows:
        if a.mig_profile:
            mig.setdefault(a.released_at, []).append(a.id)
    t = MigClaim.__table__
    for ends, ids in mig.items():
        session.execute(
            update(t)
            .where(t.c.allocation_id.in_(ids), t.c.released_at.is_(None))
            .values(released_at=ends)
        )
    claim(session, [(a, where[a.node_id][0]) for a in rows], sign=-1)
    metering.ingest(session, stopped)
    return len(rows)
