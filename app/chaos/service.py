"""Chaos experiments: inject faults through the telemetry path, as dcgm-exporter would report
them, within a blast radius; report what the health loop did and whether the invariants held.

An experiment never writes health states or allocations: its faults are samples handed to the
same ingest as node agents' (`app.health.telemetry.ingest`), in the experiment's transaction."""

from __future__ import annotations

import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.chaos.schemas import (
    EccFault,
    ExperimentIn,
    FaultIn,
    NamedTarget,
    NodeLossFault,
    NodeTarget,
    NoisyNeighbourFault,
    NvlinkFault,
    ProviderFault,
    RackTarget,
    ThrottleFault,
    XidFault,
)
from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.core.errors import Conflict, Forbidden, NotFound
from app.core.schemas import PageParams, paginate
from app.health import actions, telemetry
from app.health.actions import Scope
from app.health.service import breaker_limits, report_step_times
from app.health.states import Actor
from app.models.chaos import ChaosExperiment, ChaosInjection
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import PLACEABLE, HealthEvent, HealthIncident
from app.models.metering import UsageEvent
from app.models.workloads import Allocation, GpuUsage, Workload, WorkloadEvent
from app.placement.catalog import GPU_MODELS
from app.scheduling import providers

OUT_STATES = ("quarantined", "unreachable", "out_of_service", "suspect")


class ChaosDisabled(Forbidden):
    code = "chaos_disabled"
    title = "Chaos experiments are off"


class UnknownTarget(NotFound):
    code = "unknown_target"
    title = "No such GPU"


class NotEnoughTargets(Conflict):
    code = "not_enough_targets"
    title = "Not enough GPUs match the target"


class BlastRadiusExceeded(Conflict):
    """Refused against the fleet as it is now: not a malformed request."""

    code = "blast_radius_exceeded"
    title = "Beyond the blast radius"


Fault = FaultIn
SHARED_TIERS = ("timeslice", "mps")  # one tenant per GPU (app/placement/isolation.py)
# Injected on a node (all its GPUs), not on one GPU.
NODE_FAULTS = (NodeLossFault, NvlinkFault, ProviderFault)
NVLINK_XID = 74
# Reports of a throttled GPU: one per 30 s over the last six minutes (enough for the health
# loop's averages to pass its thresholds), as an agent would have sent them.
THROTTLE_REPORTS = 12


def _rule(f: Fault) -> actions.Rule:
    if isinstance(f, XidFault):
        return actions.rule_for_xid(f.code)
    if isinstance(f, NvlinkFault):
        return actions.rule_for_xid(NVLINK_XID)
    if isinstance(f, (NodeLossFault, ProviderFault)):  # a provider fault: at worst, the node
        return actions.SIGNALS["heartbeat_lost"]
    if isinstance(f, NoisyNeighbourFault):  # nothing leaves service: the GPU is only busy
        return actions.rule_for_xid(13)
    return actions.SIGNALS["ecc_dbe" if isinstance(f, EccFault) else "hw_slowdown"]


def _targets(session: Session, f: Fault, rng: random.Random) -> list[tuple[Node, int | None]]:
    """(node, GPU index) per target. A GPU fault aimed at a node or rack hits each of their
    GPUs; a node fault's targets are nodes (index None), an NVLink fault's every node of the
    target's NVLink domain."""
    found = _named(session, f.target, rng)
    if not isinstance(f, NODE_FAULTS):
        gpus_of = _gpu_indices(session, [n for n, g in found if g is None])
        return [(n, x) for n, g in found for x in ([g] if g is not None else gpus_of[n.id])]
    nodes = {n.id: n for n, _ in found}
    if isinstance(f, NvlinkFault):
        domains = {n.nvlink_domain for n in nodes.values()}
        nodes = {
            n.id: n
            for n in session.scalars(select(Node).where(Node.nvlink_domain.in_(sorted(domains))))
        }
    return [(n, None) for n in sorted(nodes.values(), key=lambda n: n.name)]


def _named(session: Session, t: Any, rng: random.Random) -> list[tuple[Node, int | None]]:
    if isinstance(t, NodeTarget):
        node = session.scalar(select(Node).where(Node.name == t.node))
        if node is None:
            raise UnknownTarget(f"No node named {t.node}.")
        return [(node, None)]
    if isinstance(t, RackTarget):
        nodes = session.scalars(
            select(Node).join(Rack, Node.rack_id == Rack.id).where(Rack.name == t.rack)
        ).all()
        if not nodes:
            raise UnknownTarget(f"No rack named {t.rack}, or no nodes in it.")
        return [(n, None) for n in sorted(nodes, key=lambda n: n.name)]
    if isinstance(t, NamedTarget):
        node = session.scalar(select(Node).where(Node.name == t.node))
        if (
            node is None
            or session.scalar(select(Gpu.id).where(Gpu.node_id == node.id, Gpu.index == t.gpu))
            is None
        ):
            raise UnknownTarget(f"No GPU {t.gpu} on a node named {t.node}.")
        return [(node, t.gpu)]

    stmt = (
        select(Allocation.node_id, Allocation.gpu_indices)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(Allocation.released_at.is_(None), Workload.state == "running")
    )
    if t.holding_tier:
        stmt = stmt.where(Allocation.tier == t.holding_tier)
    if t.region:
        stmt = stmt.where(Workload.region == t.region)
    held = sorted({(nid, g) for nid, gs in session.execute(stmt) for g in gs})
    if len(held) < t.random_gpus:
        raise NotEnoughTargets(
            f"Only {len(held)} GPUs hold running work matching the target; "
            f"{t.random_gpus} were asked for.",
        )
    picked = rng.sample(held, t.random_gpus)
    nodes = {
        n.id: n for n in session.scalars(select(Node).where(Node.id.in_({p[0] for p in picked})))
    }
    return [(nodes[nid], g) for nid, g in picked]


def _touched(session: Session, plan: list[tuple[Fault, Node, int | None]]) -> dict[str, set]:
    """Per region, the GPUs the faults touch: each targeted GPU, and every GPU of its node when
    the action table's effect reaches the node (a reboot, a lost node, an NVLink domain)."""
    out: dict[str, set] = {}
    regions: dict = {}
    node_gpus: dict = {}
    for f, node, gpu in plan:
        scope, _repair = actions.EFFECT[_rule(f).action]
        if node.rack_id not in regions:
            regions[node.rack_id] = session.scalar(
                select(Region.name)
                .join(Rack, Rack.region_id == Region.id)
                .where(Rack.id == node.rack_id)
            )
        gpus = {(node.id, gpu)}
        if scope is Scope.domain:  # e.g. Xid 74 on one GPU drains the whole NVLink domain
            gpus = {
                (nid, g)
                for nid, g in session.execute(
                    select(Gpu.node_id, Gpu.index)
                    .join(Node, Gpu.node_id == Node.id)
                    .where(Node.nvlink_domain == node.nvlink_domain)
                )
            }
        elif scope >= Scope.node or gpu is None:
            if node.id not in node_gpus:
                node_gpus[node.id] = list(
                    session.scalars(select(Gpu.index).where(Gpu.node_id == node.id))
                )
            gpus = {(node.id, g) for g in node_gpus[node.id]}
        out.setdefault(regions[node.rack_id], set()).update(gpus)
    return out


def start(session: Session, body: ExperimentIn) -> ChaosExperiment:
    """Check the experiment against its blast radius, then inject its faults now, or schedule
    them (at a time, and again every so often)."""
    if not get_settings().chaos_enabled:
        raise ChaosDisabled(
            "Chaos experiments are off on this deployment; set RACKPLANE_CHAOS_ENABLED=true."
        )
    exp_id = uuid.uuid4()
    plan, touched = _plan(session, body, random.Random(exp_id.int), {})
    now = utcnow()
    sched = body.schedule
    first = sched.at.astimezone(UTC) if sched is not None and sched.at is not None else None
    later = first is not None and first > now
    exp = ChaosExperiment(
        id=exp_id,
        name=body.name,
        state="scheduled" if later else "running",
        spec=body.model_dump(mode="json"),
        gpus_touched=0,
        started_at=now,
        created_at=now,
        next_at=first if later else None,
    )
    session.add(exp)
    session.flush()
    audit.record_system(
        session,
        "chaos.start",
        [
            (
                None,
                "chaos_experiment",
                exp.id,
                {},
                {
                    "name": exp.name,
                    "faults": [f.model_dump(mode="json") for f in body.faults],
                    "blast_radius": body.blast_radius.model_dump(),
                    "schedule": sched.model_dump(mode="json") if sched else None,
                },
            )
        ],
    )
    if not later:
        _round(session, exp, body, plan, touched, now)
    return exp


def list_experiments(
    session: Session, page: PageParams, *, state: str | None = None
) -> tuple[list[ChaosExperiment], str | None]:
    """Experiments, oldest first (a page of them), optionally in one state."""
    stmt = select(ChaosExperiment)
    if state is not None:
        stmt = stmt.where(ChaosExperiment.state == state)
    return paginate(session, stmt, ChaosExperiment, page)


def fire_due(session: Session) -> list[uuid.UUID]:
    """Run the rounds of scheduled and repeating experiments that are due. A round whose
    targets would pass the blast radius (with what earlier rounds touched) aborts the
    experiment instead. Returns the experiments that ran a round."""
    now = utcnow()
    fired = []
    for exp in session.scalars(
        select(ChaosExperiment)
        .where(ChaosExperiment.state.in_(("scheduled", "running")), ChaosExperiment.next_at <= now)
        .with_for_update(skip_locked=True)
    ):
        # Claim the round: an experiment stopped meanwhile (SQLite has no row locks) is left be.
        claimed = session.execute(
            update(ChaosExperiment)
            .where(
                ChaosExperiment.id == exp.id,
                ChaosExperiment.state == exp.state,
                ChaosExperiment.rounds == exp.rounds,
            )
            .values(next_at=None)
            .execution_options(synchronize_session=False)
        ).rowcount
        if claimed != 1:
            continue
        body = ExperimentIn.model_validate(exp.spec)
        try:
            with session.begin_nested():
                plan, touched = _plan(
                    session, body, random.Random(exp.id.int + exp.rounds), exp.touched or {}
                )
                if exp.state == "scheduled":
                    exp.state, exp.started_at = "running", now
                _round(session, exp, body, plan, touched, now)
        except (BlastRadiusExceeded, NotEnoughTargets, UnknownTarget) as e:
            stop(session, exp, abort_reason=f"round {exp.rounds + 1}: {e.detail}")
            continue
        fired.append(exp.id)
    return fired


def _plan(
    session: Session, body: ExperimentIn, rng: random.Random, before: dict[str, int]
) -> tuple[list[tuple[Fault, Node, int | None]], dict[str, int]]:
    """The round's targets, checked against the blast radius with the GPUs earlier rounds
    touched (`before`, per region). Returns them and the GPUs they touch per region."""
    plan = [(f, node, gpu) for f in body.faults for node, gpu in _targets(session, f, rng)]
    for f, node, gpu in plan:
        if isinstance(f, NoisyNeighbourFault) and len(_sharers(session, node, gpu or 0)) < 2:
            raise NotEnoughTargets(
                f"GPU {gpu} of {node.name} is not shared by two running workloads "
                "(time-slicing or MPS): there is no neighbour to be noisy."
            )
    touched = _touched(session, plan)
    total = sum(len(v) for v in touched.values())
    br = body.blast_radius
    touched_before = sum(before.values())
    if touched_before + total > br.max_gpus:
        earlier = f" (earlier rounds: {touched_before})" if touched_before else ""
        raise BlastRadiusExceeded(
            f"The faults would take {total} GPUs out{earlier}; the blast radius allows "
            f"{br.max_gpus}.",
            gpus=total,
        )
    for region, gpus in sorted(touched.items()):
        size = session.scalar(
            select(func.count(Gpu.id))
            .join(Node, Gpu.node_id == Node.id)
            .join(Rack, Node.rack_id == Rack.id)
            .join(Region, Rack.region_id == Region.id)
            .where(Region.name == region)
        )
        had = before.get(region, 0)
        if had + len(gpus) > br.max_region_share * (size or 0):
            earlier = f" (earlier rounds: {had})" if had else ""
            raise BlastRadiusExceeded(
                f"The faults would take {len(gpus)} of region {region}'s {size} GPUs "
                f"out{earlier}; the blast radius allows {br.max_region_share:.0%}.",
                gpus=len(gpus),
            )
    return plan, {r: len(g) for r, g in touched.items()}


def _round(
    session: Session,
    exp: ChaosExperiment,
    body: ExperimentIn,
    plan: list[tuple[Fault, Node, int | None]],
    touched: dict[str, int],
    now: datetime,
) -> None:
    """Inject one round of the experiment's faults; schedule the next, if any."""
    total = sum(touched.values())
    exp.rounds += 1
    exp.gpus_touched += total
    before = dict(exp.touched or {})
    exp.touched = {r: before.get(r, 0) + touched.get(r, 0) for r in {*before, *touched}}
    sched = body.schedule
    more = sched is not None and exp.rounds < sched.times
    exp.next_at = now + timedelta(seconds=sched.every_s) if more and sched else None
    _inject(session, exp, plan, now)
    audit.record_system(
        session,
        "chaos.inject",
        [
            (
                None,
                "chaos_experiment",
                exp.id,
                {},
                {
                    "round": exp.rounds,
                    "faults": [[f.kind, getattr(f, "code", None), n.name, g] for f, n, g in plan],
                    "gpus_touched": total,
                },
            )
        ],
    )


def _inject(
    session: Session,
    exp: ChaosExperiment,
    plan: list[tuple[Fault, Node, int | None]],
    now: datetime,
) -> None:
    samples: list[tuple] = []
    targets: dict = {}
    reports: dict[int, list] = {}
    lost: list[Node] = []
    noisy: list[tuple[NoisyNeighbourFault, Node, int | None]] = []
    ts = time.time()
    gpus_of = _gpu_indices(session, [n for f, n, g in plan if g is None])
    for i, (f, node, gpu) in enumerate(plan):
        session.add(
            ChaosInjection(
                experiment_id=exp.id,
                kind=f.kind,
                code=f.code
                if isinstance(f, XidFault)
                else NVLINK_XID
                if isinstance(f, NvlinkFault)
                else None,
                detail=f.fails if isinstance(f, ProviderFault) else None,
                node_id=node.id,
                node=node.name,
                gpu_index=gpu,
                injected_at=now,
            )
        )
        if isinstance(f, NodeLossFault):
            lost.append(node)
            continue
        if isinstance(f, ProviderFault):
            providers.break_nodes(session, [node.name], f.fails, exp.id)
            continue
        if isinstance(f, NoisyNeighbourFault):
            noisy.append((f, node, gpu))
            continue
        if isinstance(f, NvlinkFault):  # every GPU of the node reports Xid 74
            for g in gpus_of[node.id]:
                key = (node.name, str(g), None)
                targets[key] = key
                samples += [
                    (i, key, "DCGM_FI_DEV_XID_ERRORS", 0.0, ts),
                    (i, key, "DCGM_FI_DEV_XID_ERRORS", float(NVLINK_XID), ts),
                ]
            continue
        key = (node.name, str(gpu), None)
        targets[key] = key
        if isinstance(f, XidFault):  # the gauge clears, then shows the code: a new Xid
            samples += [
                (i, key, "DCGM_FI_DEV_XID_ERRORS", 0.0, ts),
                (i, key, "DCGM_FI_DEV_XID_ERRORS", float(f.code or 0), ts),
            ]
        elif isinstance(f, ThrottleFault):
            clock = _max_clock(node) * f.speed
            hot = float(actions.THROTTLE_HW_THERMAL)
            # One report per batch, as an agent pushes them: the loop's averages count
            # reports, not samples.
            for k in range(THROTTLE_REPORTS):
                t = ts - 30 * (THROTTLE_REPORTS - 1 - k)
                reports.setdefault(k, []).extend(
                    [
                        (i, key, "DCGM_FI_DEV_GPU_UTIL", 95.0, t),
                        (i, key, "DCGM_FI_DEV_SM_CLOCK", clock, t),
                        (i, key, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", hot, t),
                    ]
                )
        else:  # the counter from a fresh baseline, then one more error
            samples += [
                (i, key, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0.0, ts),
                (i, key, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1.0, ts),
            ]
    session.flush()
    if samples:
        telemetry.ingest(session, samples, targets)
    for _k, batch in sorted(reports.items()):
        telemetry.ingest(session, batch, dict(targets))
    for f, node, gpu in noisy:
        _make_noise(session, f, node, gpu or 0, ts)
    if lost:
        # The agents' last words (a report now: the heartbeat the control plane will miss),
        # then the network between them and us is cut.
        telemetry.ingest(session, [], {}, heartbeat_nodes=[n.name for n in lost])
        for n in lost:
            telemetry.partition(session, n.id, True)


def _sharers(session: Session, node: Node, gpu: int) -> list:
    """Running workloads sharing GPU `gpu` of `node` (time-slicing, MPS), largest share first."""
    rows = session.execute(
        select(Workload, Allocation.milli, Allocation.gpu_indices)
        .join(Allocation, Allocation.workload_id == Workload.id)
        .where(
            Allocation.node_id == node.id,
            Allocation.released_at.is_(None),
            Allocation.tier.in_(SHARED_TIERS),
            Workload.state == "running",
        )
    ).all()
    mine = [(w, milli) for w, milli, gpus in rows if gpu in (gpus or ())]
    mine.sort(key=lambda x: (-x[1], as_aware(x[0].created_at), str(x[0].id)))
    return [w for w, _ in mine]


def _make_noise(session: Session, f: NoisyNeighbourFault, node: Node, gpu: int, ts: float) -> None:
    """The GPU reports itself saturated for the last few minutes (one report per 30 s); then
    every sharer but the largest reports its step time, first at its best pace, then slowed
    down, through the same service call as the API's progress route."""
    key = (node.name, str(gpu), None)
    for k in range(THROTTLE_REPORTS):
        t = ts - 30 * (THROTTLE_REPORTS - 1 - k)
        telemetry.ingest(session, [(0, key, "DCGM_FI_DEV_GPU_UTIL", 100.0, t)], {key: key})
    session.flush()
    _loud, *victims = _sharers(session, node, gpu)
    for w in victims:
        best = w.step_time_best_s or 1.0
        report_step_times(session, w, {0: best})
        report_step_times(session, w, {0: best * f.slowdown})


def _quiet(session: Session, inj: ChaosInjection) -> None:
    """Undo a noisy neighbour for the victims it made: their best pace was the experiment's
    (forgotten: their own reports set it again), the GPU is no longer to be avoided, and a move
    that has not happened yet is called off."""
    told = {
        e.workload_id
        for e in session.scalars(
            select(WorkloadEvent).where(
                WorkloadEvent.kind == "health", WorkloadEvent.at >= as_aware(inj.injected_at)
            )
        )
        if (e.details or {}).get("reason") == "noisy_neighbour"
        and (e.details or {}).get("node") == inj.node
        and (e.details or {}).get("gpu") == inj.gpu_index
    }
    where_ = [inj.node, inj.gpu_index]
    for w in session.scalars(select(Workload).where(Workload.id.in_(told)).with_for_update()):
        w.step_time_best_s = None
        if where_ in (w.avoid_gpus or []):
            w.avoid_gpus = [x for x in w.avoid_gpus or [] if x != where_] or None
            w.migrate_at_checkpoint = False


def _gpu_indices(session: Session, nodes: list[Node]) -> dict[uuid.UUID, list[int]]:
    return _gpu_indices_by_id(session, [n.id for n in nodes])


def _gpu_indices_by_id(session: Session, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[int]]:
    out: dict[uuid.UUID, list[int]] = {i: [] for i in ids}
    if ids:
        for node_id, index in session.execute(
            select(Gpu.node_id, Gpu.index)
            .where(Gpu.node_id.in_(list(out)))
            .order_by(Gpu.node_id, Gpu.index)
        ):
            out[node_id].append(index)
    return out


def _max_clock(node: Node) -> float:
    m = GPU_MODELS.get(node.gpu_model)
    return float(m.sm_clock_mhz) if m and m.sm_clock_mhz else 1980.0


def stop(session: Session, exp: ChaosExperiment, abort_reason: str | None = None) -> None:
    """Stop the experiment and undo what it injected (an Xid gauge clears; what the health loop
    did about the faults stays its own business, released by operators). With a reason, it
    was aborted by one of its conditions. A scheduled round that has not run never will."""
    if exp.state not in ("running", "scheduled"):
        return
    now = utcnow()
    exp.next_at = None
    samples: list[tuple] = []
    targets: dict = {}
    back: list[ChaosInjection] = []
    injections = list(
        session.scalars(
            select(ChaosInjection).where(
                ChaosInjection.experiment_id == exp.id, ChaosInjection.undone_at.is_(None)
            )
        )
    )
    domains = _gpu_indices_by_id(session, [i.node_id for i in injections if i.kind == "nvlink"])
    for inj in injections:
        key = (inj.node, str(inj.gpu_index), None)
        if inj.kind == "node_loss":
            back.append(inj)
        elif inj.kind == "nvlink":
            for g in domains[inj.node_id]:
                k = (inj.node, str(g), None)
                targets[k] = k
                samples.append((0, k, "DCGM_FI_DEV_XID_ERRORS", 0.0, time.time()))
        elif inj.kind == "xid":
            targets[key] = key
            samples.append((0, key, "DCGM_FI_DEV_XID_ERRORS", 0.0, time.time()))
        elif inj.kind == "throttle":  # the slowdown ends (its measured speed fades back)
            targets[key] = key
            samples.append((0, key, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0.0, time.time()))
        elif inj.kind == "noisy_neighbour":  # the load is gone
            targets[key] = key
            samples.append((0, key, "DCGM_FI_DEV_GPU_UTIL", 0.0, time.time()))
            _quiet(session, inj)
        inj.undone_at = now
    session.flush()
    # The network is back first (what follows must arrive): a node another experiment still
    # cuts off stays cut off.
    still = set(
        session.scalars(
            select(ChaosInjection.node_id)
            .join(ChaosExperiment, ChaosExperiment.id == ChaosInjection.experiment_id)
            .where(
                ChaosInjection.kind == "node_loss",
                ChaosInjection.undone_at.is_(None),
                ChaosExperiment.id != exp.id,
            )
        )
    )
    back = [inj for inj in back if inj.node_id not in still]
    for inj in back:
        telemetry.partition(session, inj.node_id, False)
    if samples:
        telemetry.ingest(session, samples, targets)
    providers.mend(session, exp.id)
    if back:
        # The agents' next reports arrive (the node returns through validation, as any node
        # whose agent speaks again).
        telemetry.ingest(session, [], {}, heartbeat_nodes=sorted({i.node for i in back}))
    exp.state, exp.stopped_at = ("aborted" if abort_reason else "stopped"), now
    exp.abort_reason = abort_reason
    audit.record_system(
        session,
        "chaos.abort" if abort_reason else "chaos.stop",
        [(None, "chaos_experiment", exp.id, {}, {"reason": abort_reason} if abort_reason else {})],
    )


def check_aborts(session: Session) -> list[uuid.UUID]:
    """Abort every running experiment whose abort condition holds now. Returns their ids."""
    aborted = []
    for exp in session.scalars(
        select(ChaosExperiment).where(ChaosExperiment.state == "running").with_for_update()
    ):
        cond = (exp.spec or {}).get("abort") or {}
        why = None
        limit = cond.get("max_failed_workloads")
        if limit is not None:
            failed = session.scalar(
                select(func.count(Workload.id)).where(
                    Workload.state == "failed", Workload.finished_at >= exp.started_at
                )
            )
            if failed > limit:
                why = f"{failed} workloads failed since it started (the limit is {limit})"
        floor = cond.get("min_idle_gpus")
        if why is None and floor is not None:
            placeable = [h.value for h in PLACEABLE]
            idle = session.scalar(
                select(func.count(Gpu.id))
                .join(Node, Gpu.node_id == Node.id)
                .outerjoin(
                    GpuUsage,
                    (GpuUsage.node_id == Gpu.node_id) & (GpuUsage.gpu_index == Gpu.index),
                )
                .where(
                    Node.state == "ready",
                    Node.health.in_(placeable),
                    Gpu.health.in_(placeable),
                    func.coalesce(GpuUsage.milli_used, 0) == 0,
                )
            )
            if idle < floor:
                why = f"{idle} idle healthy GPUs left (the floor is {floor})"
        if why is not None:
            stop(session, exp, abort_reason=why)
            aborted.append(exp.id)
    return aborted


def report(session: Session, exp: ChaosExperiment) -> dict[str, Any]:
    """Per fault: when the loop detected it, took the hardware out, requeued the work and ran
    it again; the work lost; and the invariants over the experiment's history."""
    injections = list(
        session.scalars(
            select(ChaosInjection)
            .where(ChaosInjection.experiment_id == exp.id)
            .order_by(ChaosInjection.node, ChaosInjection.gpu_index)
        )
    )
    started = as_aware(exp.started_at)
    events = session.scalars(
        select(WorkloadEvent).where(WorkloadEvent.at >= started, WorkloadEvent.kind == "transition")
    ).all()
    faults, affected = [], {}
    for inj in injections:
        at = as_aware(inj.injected_at)
        inc = session.scalar(
            select(HealthIncident)
            .where(HealthIncident.node_id == inj.node_id, HealthIncident.last_signal_at >= at)
            .order_by(HealthIncident.last_signal_at)
            .limit(1)
        )
        row: dict[str, Any] = {
            "injection": inj.id,
            "node": inj.node,
            "gpu_index": inj.gpu_index,
            "incident": inc.id if inc else None,
            "action": inc.action if inc else None,
            "detect_s": None,
            "quarantine_s": None,
            "requeue_s": None,
            "running_s": None,
            "workloads": [],
            "lost_work_gpu_s": 0.0,
        }
        if inc is not None:
            hev = session.scalars(
                select(HealthEvent)
                .where(HealthEvent.incident_id == inc.id)
                .order_by(HealthEvent.id)
            ).all()
            mine = [e for e in events if (e.details or {}).get("incident") == str(inc.id)]
            acted = [as_aware(e.at) for e in hev] + [as_aware(e.at) for e in mine]
            row["detect_s"] = _since(at, min(acted)) if acted else None
            out = [as_aware(e.at) for e in hev if e.to_state in OUT_STATES]
            row["quarantine_s"] = _since(at, min(out)) if out else None
            stopped = {e.workload_id: e for e in mine if e.to_state == "preempted"}
            queued = [as_aware(e.at) for e in mine if e.to_state == "queued"]
            row["requeue_s"] = _since(at, max(queued)) if queued else None
            again = []
            for wid, e in stopped.items():
                ran = _ran_again(events, wid, e.seq)
                if ran is not None:
                    again.append(ran)
                affected[wid] = as_aware(e.at)
                row["lost_work_gpu_s"] += float((e.details or {}).get("lost_work_gpu_s") or 0)
            row["running_s"] = (
                _since(at, max(again)) if again and len(again) == len(stopped) else None
            )
            row["workloads"] = sorted(stopped)
        if inj.kind == "provider" and inj.detail == "boot":
            _boot_failures(row, at, inj.node, events)
        if inj.kind == "noisy_neighbour":
            _noisy(session, row, at, inj, events)
        faults.append(row)
    # Invariants: live double allocation of whole GPUs anywhere; usage of stopped work after its
    # fault; affected workloads whose state and allocations disagree.
    live: dict[tuple, int] = {}
    for node_id, gpus, milli in session.execute(
        select(Allocation.node_id, Allocation.gpu_indices, Allocation.milli).where(
            Allocation.released_at.is_(None)
        )
    ):
        for g in gpus:
            live[(node_id, g)] = live.get((node_id, g), 0) + milli
    doubles = sum(1 for v in live.values() if v > 1000)
    after = 0
    inconsistent = 0
    for wid, fault_at in affected.items():
        after += (
            session.scalar(
                select(func.count(UsageEvent.id)).where(
                    UsageEvent.workload_id == wid,
                    UsageEvent.kind == "stop",
                    UsageEvent.occurred_at > fault_at,
                    UsageEvent.allocation_id.in_(
                        select(Allocation.id).where(
                            Allocation.workload_id == wid, Allocation.created_at < fault_at
                        )
                    ),
                )
            )
            or 0
        )
        w = session.get(Workload, wid)
        n_live = session.scalar(
            select(func.count(Allocation.id)).where(
                Allocation.workload_id == wid, Allocation.released_at.is_(None)
            )
        )
        holding = w is not None and w.state in ("placing", "provisioning", "running")
        if holding != bool(n_live):
            inconsistent += 1
    inv = {
        "double_allocations": doubles,
        "usage_after_fault": after,
        "inconsistent_workloads": inconsistent,
        "grace_cut_short": _grace_cut_short(events),
        "breaker_exceeded": _breaker_exceeded(session, started),
        "cross_tenant_sharing": _cross_tenant_sharing(session),
    }
    return {
        "report": faults,
        "invariants": inv,
        "held": not any(inv.values()),
        "injections": injections,
    }


def _boot_failures(row: dict[str, Any], at: datetime, node: str, events) -> None:
    """A node that fails to boot: the work that failed there (back in the queue at once), and
    when all of it ran again (elsewhere, or there once the experiment stopped)."""
    failed = [
        e
        for e in events
        if e.to_state == "queued"
        and e.reason.startswith("provisioning failed")
        and node in (e.details or {}).get("nodes", ())
        and as_aware(e.at) >= at
    ]
    if not failed:
        return
    first = {}
    for e in failed:
        first.setdefault(e.workload_id, e)
    row["detect_s"] = _since(at, min(as_aware(e.at) for e in failed))
    row["requeue_s"] = _since(at, max(as_aware(e.at) for e in failed))
    again = []
    last = {wid: max(e.seq for e in failed if e.workload_id == wid) for wid in first}
    for wid, seq in last.items():
        ran = _ran_again(events, wid, seq)
        if ran is not None:
            again.append(ran)
    row["running_s"] = _since(at, max(again)) if again and len(again) == len(last) else None
    row["workloads"] = sorted(first)


def _noisy(session: Session, row: dict[str, Any], at: datetime, inj, events) -> None:
    """A noisy neighbour: the victims told (and when), moved at their checkpoint (and when),
    and running again elsewhere."""
    told = [
        e
        for e in session.scalars(
            select(WorkloadEvent).where(WorkloadEvent.at >= at, WorkloadEvent.kind == "health")
        )
        if (e.details or {}).get("reason") == "noisy_neighbour"
        and (e.details or {}).get("node") == inj.node
        and (e.details or {}).get("gpu") == inj.gpu_index
    ]
    if not told:
        return
    victims = {e.workload_id for e in told}
    row["action"] = "tell the owner; move at checkpoint"
    row["detect_s"] = _since(at, min(as_aware(e.at) for e in told))
    moved = [
        e
        for e in events
        if e.workload_id in victims
        and e.to_state == "preempted"
        and (e.details or {}).get("reason") == "noisy_neighbour"
    ]
    if moved:
        row["requeue_s"] = _since(at, max(as_aware(e.at) for e in moved))
        again = []
        for m in moved:
            ran = _ran_again(events, m.workload_id, m.seq)
            if ran is not None:
                again.append(ran)
        row["running_s"] = _since(at, max(again)) if len(again) == len(moved) else None
        row["lost_work_gpu_s"] = sum(
            float((e.details or {}).get("lost_work_gpu_s") or 0) for e in moved
        )
    row["workloads"] = sorted(victims)


def _cross_tenant_sharing(session: Session) -> int:
    """GPUs time-sliced or MPS-shared by live work of more than one tenant (the isolation tiers
    forbid it; an experiment's noisy neighbour is always a neighbour of the same tenant)."""
    tenants: dict[tuple, set] = {}
    for node_id, gpus, tenant in session.execute(
        select(Allocation.node_id, Allocation.gpu_indices, Workload.tenant_id)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(Allocation.released_at.is_(None), Allocation.tier.in_(SHARED_TIERS))
    ):
        for g in gpus or ():
            tenants.setdefault((node_id, g), set()).add(tenant)
    return sum(1 for ts in tenants.values() if len(ts) > 1)


def _grace_cut_short(events) -> int:
    """Preempted work stopped before the deadline its notice gave (its grace period), by the
    scheduler: faults and exits may end it sooner, the grace period may not."""
    deadline: dict[uuid.UUID, datetime] = {}
    short = 0
    for e in sorted(events, key=lambda e: (e.workload_id, e.seq)):
        if e.to_state == "checkpointing" and (e.details or {}).get("deadline"):
            deadline[e.workload_id] = as_aware(datetime.fromisoformat(e.details["deadline"]))
        elif (
            e.from_state == "checkpointing"
            and e.to_state == "preempted"
            and e.reason.startswith("grace period over")
            and e.workload_id in deadline
        ):
            if (deadline.pop(e.workload_id) - as_aware(e.at)).total_seconds() > 1.0:
                short += 1
    return short


def _breaker_exceeded(session: Session, since: datetime) -> int:
    """Automatic take-outs since the experiment started that left more of a region's or a
    rack's GPUs out within the breaker's window than its limits allow."""
    window = get_settings().breaker_window_seconds
    rows = session.execute(
        select(HealthEvent.region, HealthEvent.rack, HealthEvent.taken_out, HealthEvent.at)
        .where(
            HealthEvent.actor == Actor.system.value,
            HealthEvent.taken_out > 0,
            HealthEvent.at >= since - timedelta(seconds=window),
        )
        .order_by(HealthEvent.at)
    ).all()
    if not rows:
        return 0
    sizes = {
        (region, rack): n
        for region, rack, n in session.execute(
            select(Region.name, Rack.name, func.count(Gpu.id))
            .join(Node, Gpu.node_id == Node.id)
            .join(Rack, Node.rack_id == Rack.id)
            .join(Region, Rack.region_id == Region.id)
            .group_by(Region.name, Rack.name)
        )
    }
    region_size: dict[str, int] = {}
    for (region, _rack), n in sizes.items():
        region_size[region] = region_size.get(region, 0) + n
    exceeded = 0
    for i, (region, rack, _n, at) in enumerate(rows):
        if as_aware(at) < since:
            continue
        lo = as_aware(at) - timedelta(seconds=window)
        recent = [r for r in rows[: i + 1] if as_aware(r[3]) > lo]
        lim_region, lim_rack = breaker_limits(
            region_size.get(region, 0), sizes.get((region, rack), 0)
        )
        if sum(r[2] for r in recent if r[0] == region) > lim_region or (
            sum(r[2] for r in recent if r[0] == region and r[1] == rack) > lim_rack
        ):
            exceeded += 1
    return exceeded


def _ran_again(events, workload_id: uuid.UUID, after_seq: int) -> datetime | None:
    """When the workload next ran after its event `after_seq`, if it did."""
    run = [
        e.at
        for e in events
        if e.workload_id == workload_id and e.to_state == "running" and e.seq > after_seq
    ]
    return as_aware(min(run)) if run else None


def _since(a: datetime, b: datetime) -> float:
    return round((b - a).total_seconds(), 3)


def experiment_view(session: Session, exp: ChaosExperiment) -> dict:
    """An experiment with its report, as REST, GraphQL and the CLI show it."""
    r = report(session, exp)
    return {
        "id": exp.id,
        "name": exp.name,
        "state": exp.state,
        "rounds": exp.rounds,
        "next_at": exp.next_at,
        "abort_reason": exp.abort_reason,
        "gpus_touched": exp.gpus_touched,
        "started_at": exp.started_at,
        "stopped_at": exp.stopped_at,
        "injections": r["injections"],
        "report": r["report"],
        "invariants": r["invariants"],
        "held": r["held"],
    }
