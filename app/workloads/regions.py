"""Where a submission goes, read from the fleet: the region chosen for it, and whether that
region's fleet could ever hold it (see feasibility.py). Both reads are cached for a few seconds
in this process: the fleet changes by imports and node states, not per request."""

from __future__ import annotations

import time
import uuid

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.errors import ValidationFailed
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.workloads import Workload
from app.scheduling import lifecycle
from app.scheduling.lifecycle import State
from app.scheduling.pending import no_runtime, node_states
from app.workloads.feasibility import NodeCap, never_fits
from app.workloads.schemas import WorkloadCreate


class NoMatchingCapacity(ValidationFailed):
    code = "no_matching_capacity"
    title = "No such GPUs in the fleet"


_REGIONS: dict[tuple, tuple[float, str | None]] = {}
REGION_CACHE_SECONDS = 5.0


def choose_region(session: Session, body: WorkloadCreate) -> str:
    """The region named, or the one with the most GPUs of the allowed models. A request no
    region could ever hold is refused now rather than queued forever. Answers are cached for a
    few seconds (the fleet changes by imports, not per request)."""
    key = (tuple(sorted(body.gpu_models)), body.region)
    hit = _REGIONS.get(key)
    if hit is not None and time.monotonic() - hit[0] < REGION_CACHE_SECONDS and hit[1]:
        return hit[1]
    region = _region_query(session, body)
    _REGIONS[key] = (time.monotonic(), region)
    return region


def forget_regions() -> None:
    """The fleet changed (in this process): choose regions afresh."""
    _REGIONS.clear()
    _NODES.clear()


def _region_query(session: Session, body: WorkloadCreate) -> str:
    stmt = (
        select(Region.name, func.count(Gpu.id))
        .select_from(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .group_by(Region.name)
        .order_by(func.count(Gpu.id).desc(), Region.name)
    )
    if body.gpu_models:
        stmt = stmt.where(Gpu.model.in_(body.gpu_models))
    if body.region:
        stmt = stmt.where(Region.name == body.region)
    row = session.execute(stmt.limit(1)).first()
    if row is None:
        where = f" in region {body.region!r}" if body.region else ""
        models = ", ".join(body.gpu_models) or "any model"
        raise NoMatchingCapacity(f"The fleet has no GPUs of {models}{where}.")
    return row[0]


class DoesNotFitFleet(ValidationFailed):
    code = "does_not_fit_fleet"
    title = "The fleet could never hold this request"


_NODES: dict[str, tuple[float, list]] = {}


def region_nodes(session: Session, region: str) -> list:
    """The region's nodes as feasibility sees them, cached like regions (a few seconds)."""
    hit = _NODES.get(region)
    if hit is not None and time.monotonic() - hit[0] < REGION_CACHE_SECONDS:
        return hit[1]
    rows = session.execute(
        select(Node.gpu_model, func.count(Gpu.id), Node.nvlink_domain, Rack.name, Rack.block)
        .select_from(Node)
        .join(Gpu, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == region, Node.state != "retired")
        .group_by(Node.id, Node.gpu_model, Node.nvlink_domain, Rack.name, Rack.block)
    )
    nodes = [NodeCap(m, int(n), d, r, b) for m, n, d, r, b in rows]
    _NODES[region] = (time.monotonic(), nodes)
    return nodes


def never_fits_row(session: Session, w: Workload) -> str | None:
    """`never_fits` for a workload (stored, or built for a dry-run): its shape as submitted."""
    return never_fits(
        region_nodes(session, w.region or ""),
        models=w.shape.gpu_models,
        unit=w.shape.unit,
        gpus=w.shape.gpus,
        replicas=w.replicas,
        kind=w.kind,
        confidential=w.tier == "confidential-vm",
        topology=w.topology,
    )


def fail_what_no_longer_fits(session: Session, region: str) -> int:
    """After the region's fleet shrank for good: waiting work it could never hold now fails
    with the reason, instead of waiting silently. Returns how many."""
    forget_regions()
    failed = 0
    for w in session.scalars(
        select(Workload)
        .where(Workload.region == region, Workload.state == State.queued.value)
        .order_by(Workload.id)
        .with_for_update()
    ):
        why = never_fits_row(session, w)
        if why:
            lifecycle.transition(
                session,
                w,
                State.failed,
                f"the fleet can no longer hold it: {why}",
                {"cause": "does_not_fit_fleet", "reason": why},
            )
            failed += 1
    return failed


# Nodes named in a dry-run's "waits" reason, at most: then how many more.
WAIT_NAMES = 5


def why_waiting(
    session: Session,
    region: str,
    models: tuple[str, ...],
    mig_profile: str | None = None,
    runtime: str | None = None,
) -> str:
    """Why work that fits the region's fleet (`never_fits` found nothing) cannot be placed on
    it now, as far as the nodes of its models say: no node that runs its `runtime` (as
    `placed_runtime` names it), nodes that take no work now (their state, their health), nodes
    drifted from their software stack, GPUs whose MIG layout is being made. None of those:
    what runs or is starting on the nodes must end first."""
    out: list[str] = []
    nodes = node_states(session, region)
    none = no_runtime(nodes, models, runtime) if runtime else None
    if none is not None:
        return f"waits: {none}"
    for n in nodes:
        if models and n.model not in models:
            continue
        if n.out is not None:
            out.append(f"{n.name} ({n.out})")
        elif n.drifted:
            out.append(f"{n.name} (drifted from its software stack)")
        elif n.laying:
            out.append(f"{n.name} (a MIG layout being made)")
    if not out and mig_profile:
        how = (
            "agents' nodes are laid out again as waiting work asks"
            if get_settings().mig_relayout
            else "MIG layouts are the operator's here (RACKPLANE_MIG_RELAYOUT is off)"
        )
        return f"waits: no free {mig_profile} instance on the nodes now; {how}"
    if not out:
        return "waits: what runs or is starting on the nodes must end first"
    more = f" and {len(out) - WAIT_NAMES} more" if len(out) > WAIT_NAMES else ""
    return (
        "waits: it fits the fleet, not the nodes taking work now; out now: "
        + ", ".join(out[:WAIT_NAMES])
        + more
    )


def check_feasible(session: Session, w: Workload, body: WorkloadCreate) -> None:
    """Refuse what the region's fleet could never hold (see app/workloads/feasibility.py)."""
    why = never_fits(
        region_nodes(session, w.region or ""),
        models=tuple(body.gpu_models),
        unit=body.unit,
        gpus=body.gpus,
        replicas=body.replicas,
        kind=body.kind,
        confidential=w.tier == "confidential-vm",
        topology=body.topology.model_dump() if body.topology else None,
    )
    if why:
        raise DoesNotFitFleet(f"It would wait for ever: {why}.", region=w.region, reason=why)


def node_region(session: Session, node_id: uuid.UUID) -> str:
    return session.scalar(
        select(Region.name)
        .join(Rack, Rack.region_id == Region.id)
        .join(Node, Node.rack_id == Rack.id)
        .where(Node.id == node_id)
    )
