"""A round's faults, injected through the telemetry path (samples handed to the same ingest as
node agents'), the simulated provider and the progress route; and `stop`, which undoes them."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.chaos.schemas import (
    ExperimentIn,
    NodeLossFault,
    NoisyNeighbourFault,
    NvlinkFault,
    ProviderFault,
    ThrottleFault,
    XidFault,
)
from app.chaos.targets import (
    NVLINK_XID,
    THROTTLE_REPORTS,
    Fault,
    gpu_indices,
    gpu_indices_by_id,
    sharers,
)
from app.core.db import as_aware, utcnow
from app.health import actions, telemetry
from app.health.pace import report_step_times
from app.models.chaos import ChaosExperiment, ChaosInjection
from app.models.fleet import Node
from app.models.workloads import Workload, WorkloadEvent
from app.placement.catalog import GPU_MODELS
from app.scheduling import providers


def fire_round(
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
    """Record each of the round's faults and inject it, each through its own path."""
    samples: list[tuple] = []
    targets: dict = {}
    reports: dict[int, list] = {}
    lost: list[Node] = []
    noisy: list[tuple[NoisyNeighbourFault, Node, int | None]] = []
    ts = time.time()
    gpus_of = gpu_indices(session, [n for f, n, g in plan if g is None])
    for i, (f, node, gpu) in enumerate(plan):
        session.add(_injection(exp, f, node, gpu, now))
        if isinstance(f, NodeLossFault):
            lost.append(node)
        elif isinstance(f, ProviderFault):
            providers.break_nodes(session, [node.name], f.fails, exp.id)
        elif isinstance(f, NoisyNeighbourFault):
            noisy.append((f, node, gpu))
        elif isinstance(f, NvlinkFault):  # every GPU of the node reports Xid 74
            for g in gpus_of[node.id]:
                key = (node.name, str(g), None)
                targets[key] = key
                samples += [
                    (i, key, "DCGM_FI_DEV_XID_ERRORS", 0.0, ts),
                    (i, key, "DCGM_FI_DEV_XID_ERRORS", float(NVLINK_XID), ts),
                ]
        else:
            key = (node.name, str(gpu), None)
            targets[key] = key
            _gpu_samples(i, f, node, key, ts, samples, reports)
    session.flush()
    _deliver(session, samples, targets, reports, noisy, lost, ts)


def _injection(
    exp: ChaosExperiment, f: Fault, node: Node, gpu: int | None, now: datetime
) -> ChaosInjection:
    """The record of one fault injected (what `stop` undoes, the report reads)."""
    return ChaosInjection(
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


def _gpu_samples(
    i: int,
    f: Fault,
    node: Node,
    key: tuple,
    ts: float,
    samples: list[tuple],
    reports: dict[int, list],
) -> None:
    """One GPU's fault (Xid, throttling, ECC) as the samples its agent would send."""
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


def _deliver(
    session: Session,
    samples: list[tuple],
    targets: dict,
    reports: dict[int, list],
    noisy: list[tuple[NoisyNeighbourFault, Node, int | None]],
    lost: list[Node],
    ts: float,
) -> None:
    """The round's samples and reports ingested, its noise made, its lost nodes cut off."""
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


def _make_noise(session: Session, f: NoisyNeighbourFault, node: Node, gpu: int, ts: float) -> None:
    """The GPU reports itself saturated for the last few minutes (one report per 30 s); then
    every sharer but the largest reports its step time, first at its best pace, then slowed
    down, through the same service call as the API's progress route."""
    key = (node.name, str(gpu), None)
    for k in range(THROTTLE_REPORTS):
        t = ts - 30 * (THROTTLE_REPORTS - 1 - k)
        telemetry.ingest(session, [(0, key, "DCGM_FI_DEV_GPU_UTIL", 100.0, t)], {key: key})
    session.flush()
    _loud, *victims = sharers(session, node, gpu)
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
    domains = gpu_indices_by_id(session, [i.node_id for i in injections if i.kind == "nvlink"])
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
