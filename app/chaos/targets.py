"""What an experiment hits, checked before anything is injected: the faults' targets (named, or
drawn at random among the GPUs holding running work), the health loop's rule for each fault, and
the GPUs that rule would take out, against the experiment's blast radius."""

from __future__ import annotations

import random
import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

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
    XidFault,
)
from app.core.db import as_aware
from app.core.errors import Conflict, Forbidden, NotFound
from app.health import actions
from app.health.actions import Scope
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.workloads import Allocation, Workload


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
        gpus_of = gpu_indices(session, [n for n, g in found if g is None])
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


def plan_round(
    session: Session, body: ExperimentIn, rng: random.Random, before: dict[str, int]
) -> tuple[list[tuple[Fault, Node, int | None]], dict[str, int]]:
    """The round's targets, checked against the blast radius with the GPUs earlier rounds
    touched (`before`, per region). Returns them and the GPUs they touch per region."""
    plan = [(f, node, gpu) for f in body.faults for node, gpu in _targets(session, f, rng)]
    for f, node, gpu in plan:
        if isinstance(f, NoisyNeighbourFault) and len(sharers(session, node, gpu or 0)) < 2:
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


def sharers(session: Session, node: Node, gpu: int) -> list:
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


def gpu_indices(session: Session, nodes: list[Node]) -> dict[uuid.UUID, list[int]]:
    return gpu_indices_by_id(session, [n.id for n in nodes])


def gpu_indices_by_id(session: Session, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[int]]:
    out: dict[uuid.UUID, list[int]] = {i: [] for i in ids}
    if ids:
        for node_id, index in session.execute(
            select(Gpu.node_id, Gpu.index)
            .where(Gpu.node_id.in_(list(out)))
            .order_by(Gpu.node_id, Gpu.index)
        ):
            out[node_id].append(index)
    return out
