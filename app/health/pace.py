"""Step times: a running workload's per-rank pace points at a slow GPU (its speed score goes
down) or, on a shared GPU, at a noisy neighbour (its owner is told and the work moves)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import Conflict
from app.models.fleet import Gpu, Node
from app.models.health import GpuTelemetry
from app.models.workloads import Allocation, Workload
from app.placement.perf import from_step_times, worth_writing
from app.scheduling.lifecycle import State
from app.workloads.disruptions import tell_owner
from app.workloads.service import NotRunning


class NoRanks(Conflict):
    code = "workload_has_no_ranks"
    title = "The workload has no ranks"


def report_step_times(
    session: Session, w: Any, step_s: dict[int, float]
) -> tuple[list[int], list[int], bool]:
    """A running workload's per-rank step times: a rank slower than the gang's median points at
    its GPU, whose speed score goes down to what the times imply (evidence, dated now: it fades
    back without more). Rank r is GPU r % gpus of replica r // gpus. A workload on a shared GPU
    (time-slicing, MPS) has one rank, judged against its own best pace: a noisy neighbour.
    Returns the slow ranks, those the workload does not have (ignored), and whether a noisy
    neighbour was found."""
    if w.state != State.running.value:
        raise NotRunning(f"A {w.state} workload has no ranks to report.", state=w.state)
    per = w.shape.gpus
    if per < 1 and w.shape.milli:
        unknown = sorted(r for r in step_s if r >= 1)
        return [], unknown, 0 in step_s and shared_pace(session, w, step_s[0])
    if per < 1:
        raise NoRanks(
            "Step times are for workloads of whole GPUs; this one runs on a share or a MIG slice.",
            shape=w.shape.mig_profile or "fractional",
        )
    total = per * w.size
    unknown = sorted(r for r in step_s if r >= total)
    step_s = {r: t for r, t in step_s.items() if r < total}
    allocs = {
        a.replica: a
        for a in session.scalars(
            select(Allocation).where(
                Allocation.workload_id == w.id, Allocation.released_at.is_(None)
            )
        )
    }
    scores = from_step_times(step_s)
    slow = sorted(r for r, v in scores.items() if worth_writing(1.0, v))
    now = utcnow()
    for r in slow:
        a = allocs.get(r // per)
        if a is None or r % per >= len(a.gpu_indices):
            continue
        gpu = session.scalar(
            select(Gpu)
            .where(Gpu.node_id == a.node_id, Gpu.index == a.gpu_indices[r % per])
            .with_for_update()
        )
        if gpu is not None and worth_writing(float(gpu.perf), min(float(gpu.perf), scores[r])):
            gpu.perf = min(float(gpu.perf), scores[r])
            gpu.perf_at = now
        elif gpu is not None:
            gpu.perf_at = now  # the same evidence again: it does not fade yet
    return slow, unknown, False


# A step time this many times the workload's best, on a GPU this busy, shared with other work:
# a noisy neighbour (not the hardware: the GPU's speed score is left alone).
NOISY_SLOWDOWN = 1.5
NOISY_UTIL = 90.0


def shared_pace(session: Session, w: Any, step_s: float) -> bool:
    """Judge a shared GPU's workload by its own best pace. Slowed down while the GPU it shares
    is saturated: tell the owner (an event naming the neighbours, which the isolation tiers
    keep within its tenant), never place it on that GPU again, and, if it checkpoints, move it
    at its next checkpoint. Returns whether a noisy neighbour was found."""
    best = w.step_time_best_s
    if best is None or step_s < best:
        w.step_time_best_s = step_s
        return False
    if step_s < NOISY_SLOWDOWN * best:
        return False
    a = session.scalar(
        select(Allocation).where(Allocation.workload_id == w.id, Allocation.released_at.is_(None))
    )
    if a is None or not a.gpu_indices:
        return False
    index = a.gpu_indices[0]
    # The node's live allocations are few: the GPU's sharers are picked out here.
    others = [
        (wid, tenant)
        for wid, tenant, gpus in session.execute(
            select(Workload.id, Workload.tenant_id, Allocation.gpu_indices)
            .join(Allocation, Allocation.workload_id == Workload.id)
            .where(
                Allocation.node_id == a.node_id,
                Allocation.released_at.is_(None),
                Workload.id != w.id,
                Workload.state == "running",
            )
        )
        if index in (gpus or ())
    ]
    if not others:
        return False
    node = session.get(Node, a.node_id)
    gpu = session.scalar(select(Gpu).where(Gpu.node_id == a.node_id, Gpu.index == index))
    if node is None or gpu is None:
        return False
    # Read from the table, not the session's copy: telemetry writes it with Core statements.
    latest = session.scalar(select(GpuTelemetry.latest).where(GpuTelemetry.gpu_id == gpu.id))
    util = (latest or {}).get("util")
    if util is None or util < NOISY_UTIL:
        return False
    where_ = [node.name, index]
    if where_ in (w.avoid_gpus or []):
        return True  # told already
    mine = sorted(str(o[0]) for o in others if o[1] == w.tenant_id)
    words = (
        f"noisy neighbour: GPU {index} of {node.name} is saturated ({util:.0f}% busy) and this "
        f"workload's step time is {step_s / best:.1f}x its best; "
        + (f"workload {mine[0]} of your tenant shares it" if mine else "other work shares it")
    )
    w.avoid_gpus = [*(w.avoid_gpus or []), where_]
    tell_owner(
        session,
        w,
        words,
        {
            "reason": "noisy_neighbour",
            "node": node.name,
            "gpu": index,
            "neighbours": mine,
            "slowdown": round(step_s / best, 3),
            "util": util,
        },
        move_to="another GPU",
    )
    return True
