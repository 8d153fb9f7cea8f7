"""MIG layouts through the node agent (docs/design/mig-layouts.md).

A GPU's MIG instances exist on the host only because its agent made them. An operator (or,
next, the demand planner) asks for a layout of one GPU (`request`): the GPU must hold nothing,
and from then until the agent reports, it takes no work (`Gpu.relayout_pending` keeps it out of
the placement snapshot, and `gpu_usage.relayout`'s CHECK refuses a placement planned before).
The agent finds the layout in its desired state (`Assignments.mig_layouts`, built by `wanted`),
applies it only while the GPU is idle (`nvidia-smi mig`), and reports the instances the GPU
really has (`take`): those become `Gpu.mig_layout`, where placement puts MIG work, and their
UUIDs (in the agent's inventory) what `CUDA_VISIBLE_DEVICES` names.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.agents.schemas import MigLayoutIn, MigRelayoutOut, MigRelayoutSlot
from app.core.db import dialect_insert, utcnow
from app.core.errors import Conflict, ValidationFailed
from app.models.agents import AgentNode
from app.models.fleet import Gpu, MigRelayout, Node, Rack, Region
from app.models.workloads import GpuUsage, MigClaim
from app.placement.catalog import GPU_MODELS
from app.placement.mig import PROFILES, best_start, profile_by_name, profile_name, valid_layout
from app.scheduling import lifecycle
from app.workloads.queueing import kick_placement
from rackplane_wire import GpuInfo, MigLayout, MigLayoutReport, MigSlot

CAPABILITY = "mig-layout"


class MigLayoutRefused(Conflict):
    code = "mig_layout_refused"
    title = "The MIG layout cannot be applied now"


def plan_layout(model: str, names: list[str] | None) -> list[tuple[str, int]]:
    """Profile names (the model's, or generic keys) as (key, start) placements, largest first
    at the start that keeps the most room; [] for a whole GPU (None). ValidationFailed when
    the model has no MIG, a name is not its profile, or they do not fit one GPU."""
    if names is None:
        return []
    spec = GPU_MODELS.get(model)
    if spec is None or not spec.mig_capable:
        raise ValidationFailed(f"A {model} has no MIG.", code="mig_not_supported")
    try:
        keys = [profile_by_name(model, n).key for n in names]
    except KeyError as exc:
        raise ValidationFailed(str(exc.args[0]), code="unknown_mig_profile") from None
    used = compute = count = 0
    out: list[tuple[str, int]] = []
    for key in sorted(keys, key=lambda k: (-PROFILES[k].memory, -PROFILES[k].compute, k)):
        p = PROFILES[key]
        start = best_start(p, used, compute, count)
        if start is None:
            raise ValidationFailed(
                f"{', '.join(names)} do not fit one {model}: no room for "
                f"{profile_name(model, key)} (7 compute and 8 memory slices, at most 7 "
                "instances, at the starts each profile allows).",
                code="invalid_mig_layout",
            )
        out.append((key, start))
        used |= p.mask(start)
        compute += p.compute
        count += 1
    assert valid_layout(out)
    return sorted(out, key=lambda x: x[1])


def request(
    session: Session,
    node: Node,
    gpu_index: int,
    target: list[tuple[str, int]] | None,
    reason: str,
) -> MigRelayout:
    """Ask the node's agent to lay GPU `gpu_index` out as `target` ((profile key, start) per
    instance; None: a whole GPU). The GPU must hold nothing; a layout still pending for it is
    replaced."""
    gpu = session.scalar(
        select(Gpu).where(Gpu.node_id == node.id, Gpu.index == gpu_index).with_for_update()
    )
    if gpu is None:
        raise ValidationFailed(
            f"Node {node.name} has no GPU {gpu_index}.", code="gpu_not_found", gpu=gpu_index
        )
    layout = sorted(target or [], key=lambda x: x[1])
    assert valid_layout(layout)
    _check_agent(session, node)
    usage = _idle_usage(session, node, gpu_index, gpu.model)
    now = utcnow()
    session.execute(
        update(MigRelayout)
        .where(
            MigRelayout.node_id == node.id,
            MigRelayout.gpu_index == gpu_index,
            MigRelayout.status == "pending",
        )
        .values(status="withdrawn", finished_at=now, detail="replaced by a newer layout")
    )
    row = MigRelayout(
        id=uuid.uuid4(),
        node_id=node.id,
        gpu_index=gpu_index,
        mig_mode=target is not None,
        layout=[list(x) for x in layout],
        reason=reason,
        status="pending",
        requested_at=now,
    )
    session.add(row)
    usage.relayout = True
    gpu.relayout_pending = True  # out of the placement snapshot until the agent reports
    lifecycle.nodes_changed(session, [node.name])
    session.flush()
    return row


def _check_agent(session: Session, node: Node) -> None:
    """MigLayoutRefused unless the node has an agent that says it can lay out MIG."""
    agent = session.get(AgentNode, node.id)
    if agent is None or CAPABILITY not in ((agent.inventory or {}).get("capabilities") or []):
        raise MigLayoutRefused(
            f"Node {node.name}'s agent cannot lay out MIG instances (no agent, or one that does "
            "not say it can).",
            code="agent_cannot_lay_out_mig",
        )


def _idle_usage(session: Session, node: Node, gpu_index: int, model: str) -> GpuUsage:
    """The GPU's usage row, locked; MigLayoutRefused if anything holds the GPU."""
    # Made if the GPU never held anything, so that there is a row to lock.
    session.execute(
        dialect_insert(session, GpuUsage)
        .values(
            node_id=node.id,
            gpu_index=gpu_index,
            milli_used=0,
            memory_mib=GPU_MODELS[model].memory_mib,
            memory_used_mib=0,
            relayout=False,
        )
        .on_conflict_do_nothing(index_elements=[GpuUsage.node_id, GpuUsage.gpu_index])
    )
    usage = session.scalar(
        select(GpuUsage)
        .where(GpuUsage.node_id == node.id, GpuUsage.gpu_index == gpu_index)
        .with_for_update()
    )
    assert usage is not None
    claims = session.scalar(
        select(func.count())
        .select_from(MigClaim)
        .where(
            MigClaim.node_id == node.id,
            MigClaim.gpu_index == gpu_index,
            MigClaim.released_at.is_(None),
        )
    )
    if usage.milli_used or usage.memory_used_mib or claims:
        raise MigLayoutRefused(
            f"GPU {gpu_index} of {node.name} holds work: a layout changes only on an idle GPU "
            "(drain it, or wait).",
            code="gpu_busy",
        )
    return usage


def wanted(session: Session, node_id: uuid.UUID) -> list[MigLayout]:
    """The node's pending layouts, as its agent is told them."""
    rows = session.execute(
        select(MigRelayout, Node.gpu_model)
        .join(Node, Node.id == MigRelayout.node_id)
        .where(MigRelayout.node_id == node_id, MigRelayout.status == "pending")
        .order_by(MigRelayout.gpu_index)
    ).all()
    return [
        MigLayout(
            id=str(r.id),
            gpu=r.gpu_index,
            mig_mode=r.mig_mode,
            instances=[MigSlot(profile=profile_name(model, k), start=s) for k, s in r.layout],
        )
        for r, model in rows
    ]


def take(session: Session, node: Node, reports: list[MigLayoutReport]) -> int:
    """The agent's reports on its layouts: what each GPU now has is recorded (placement uses
    it), the layout closed, and the GPU free to take work again. Returns how many were news."""
    news = 0
    for rep in reports:
        try:
            rid = uuid.UUID(rep.id)
        except ValueError:
            continue
        row = session.scalar(
            select(MigRelayout)
            .where(MigRelayout.id == rid, MigRelayout.node_id == node.id)
            .with_for_update()
        )
        if row is None or row.status != "pending":
            continue  # answered already, withdrawn, or another node's
        gpu = session.scalar(
            select(Gpu).where(Gpu.node_id == node.id, Gpu.index == row.gpu_index).with_for_update()
        )
        if gpu is None:
            continue
        now = utcnow()
        row.status, row.finished_at = rep.status, now
        row.detail = rep.detail[:500] or None
        if rep.status == "applied" or rep.instances or rep.mig_mode != gpu.mig_mode:
            _record(gpu, rep.mig_mode, _laid(gpu.model, rep.instances))
        gpu.relayout_pending = False
        session.execute(
            update(GpuUsage)
            .where(GpuUsage.node_id == node.id, GpuUsage.gpu_index == row.gpu_index)
            .values(relayout=False)
        )
        news += 1
    if news:
        lifecycle.nodes_changed(session, [node.name])
        region = session.scalar(
            select(Region.name)
            .join(Rack, Rack.region_id == Region.id)
            .where(Rack.id == node.rack_id)
        )
        kick_placement(session, region)
    return news


def _laid(model: str, instances: list[Any]) -> list[list[Any]]:
    out = []
    for i in instances:
        try:
            key = profile_by_name(model, i.profile).key
        except KeyError:
            continue  # a profile we do not know: not placeable here
        if i.start is not None:
            out.append([key, i.start])
    return sorted(out, key=lambda x: x[1])


def _record(gpu: Gpu, mig_mode: bool, layout: list[list[Any]]) -> None:
    new = layout if mig_mode else None
    if gpu.mig_mode != mig_mode:
        gpu.mig_mode = mig_mode
    if gpu.mig_layout != new:
        gpu.mig_layout = new


def learn(gpus: list[Gpu], reported: list[GpuInfo]) -> None:
    """An agent's inventory matching the fleet's record: each MIG GPU's instances as laid out
    (what placement uses on an agent's node). Writes only what changed."""
    have = {g.index: g for g in reported}
    for g in gpus:
        r = have.get(g.index)
        if r is None or g.relayout_pending:
            continue  # its agent's report of the relayout says what it has
        _record(g, g.mig_mode, _laid(g.model, r.mig_instances))


def describe(session: Session, row: MigRelayout) -> MigRelayoutOut:
    node, model = session.execute(
        select(Node.name, Node.gpu_model).where(Node.id == row.node_id)
    ).one()
    return MigRelayoutOut(
        id=row.id,
        node=node,
        gpu_index=row.gpu_index,
        mig_mode=row.mig_mode,
        layout=[MigRelayoutSlot(profile=profile_name(model, k), start=s) for k, s in row.layout],
        status=row.status,
        detail=row.detail,
        requested_at=row.requested_at,
        finished_at=row.finished_at,
    )


def request_on_gpu(session: Session, gpu: Gpu, body: MigLayoutIn, reason: str) -> MigRelayoutOut:
    """An operator's layout of one GPU, by profile names (the starts chosen here)."""
    node = session.scalar(select(Node).where(Node.id == gpu.node_id).with_for_update())
    assert node is not None
    target = plan_layout(gpu.model, body.profiles) if body.profiles is not None else None
    return describe(session, request(session, node, gpu.index, target, reason))
