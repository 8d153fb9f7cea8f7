"""MIG layouts that follow demand: the edge of the planner (app/placement/miglayout.py).

Level-triggered, one region at a time (beat `agents.mig_layouts`): layouts asked of agents that
never answered are failed; every GPU of the region's agent nodes that can lay out MIG is read
as the planner sees it (its layout, whether anything holds it, when its layout last changed
and how often in the last day), the queue as demand by class (whole GPUs by model, MIG
replicas by model and profile); the planner's decisions are asked of the agents through the
same path as an operator's (`mig.request`): only idle GPUs, out of placement until done.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.agents import mig
from app.core.config import get_settings
from app.core.errors import AppError
from app.core.logging import get_logger
from app.models.agents import AgentNode
from app.models.fleet import Gpu, MigRelayout, Node, NodeState, Rack, Region
from app.models.health import PLACEABLE
from app.models.workloads import GpuUsage, MigClaim, Workload
from app.placement.mig import PROFILES
from app.placement.miglayout import Demand, GpuView, RelayoutConfig, plan
from app.scheduling.lifecycle import State

log = get_logger(__name__)
# An agent that has not answered a layout in this long: the layout failed, the GPU is back.
ANSWER_WITHIN_S = 600.0


def timed_out(session: Session, now: datetime) -> int:
    """Fail pending layouts no agent answered in time: their GPUs take work again."""
    rows = list(
        session.scalars(
            select(MigRelayout)
            .where(
                MigRelayout.status == "pending",
                MigRelayout.requested_at < now - timedelta(seconds=ANSWER_WITHIN_S),
            )
            .with_for_update(skip_locked=True)
        )
    )
    for r in rows:
        r.status, r.finished_at = "failed", now
        r.detail = "no answer from the node's agent in time"
        session.execute(
            update(Gpu)
            .where(Gpu.node_id == r.node_id, Gpu.index == r.gpu_index)
            .values(relayout_pending=False)
        )
        session.execute(
            update(GpuUsage)
            .where(GpuUsage.node_id == r.node_id, GpuUsage.gpu_index == r.gpu_index)
            .values(relayout=False)
        )
    return len(rows)


def views(session: Session, region: str, now: datetime) -> tuple[list[GpuView], dict]:
    """The region's GPUs that the planner may re-lay, as it sees them, and their nodes."""
    placeable = [h.value for h in PLACEABLE]
    nodes = _layout_nodes(session, region, placeable)
    if not nodes:
        return [], {}
    ids = list(nodes)
    usage = {
        (u.node_id, u.gpu_index): u
        for u in session.scalars(select(GpuUsage).where(GpuUsage.node_id.in_(ids)))
    }
    held = _claimed_slices(session, ids)
    last, recent = _layout_history(session, ids, now)
    # Layouts asked and not yet made: the planner counts what they will offer, and leaves them.
    coming = {
        (r.node_id, r.gpu_index): r
        for r in session.scalars(
            select(MigRelayout).where(MigRelayout.node_id.in_(ids), MigRelayout.status == "pending")
        )
    }
    out = []
    for g in session.scalars(
        select(Gpu).where(Gpu.node_id.in_(ids)).order_by(Gpu.node_id, Gpu.index)
    ):
        if g.health not in placeable:
            continue
        key = (g.node_id, g.index)
        name = nodes[g.node_id].name
        if key in coming:
            out.append(_coming_view(g, name, coming[key], recent[key], now))
            continue
        u = usage.get(key)
        mask = held.get(key, 0)
        busy = bool(u and (u.milli_used or u.memory_used_mib)) or bool(mask)
        changed_at = last[key].timestamp() if key in last else float("-inf")
        out.append(_current_view(g, name, mask, busy, changed_at, recent[key]))
    return out, {n.name: n for n in nodes.values()}


def _layout_nodes(session: Session, region: str, placeable: list[str]) -> dict:
    """The region's ready, placeable nodes whose agents can lay out MIG, by id."""
    return {
        n.id: n
        for n, inventory in session.execute(
            select(Node, AgentNode.inventory)
            .join(AgentNode, AgentNode.node_id == Node.id)
            .join(Rack, Rack.id == Node.rack_id)
            .join(Region, Region.id == Rack.region_id)
            .where(
                Region.name == region,
                Node.state == NodeState.ready.value,
                Node.health.in_(placeable),
            )
        ).all()
        if mig.CAPABILITY in ((inventory or {}).get("capabilities") or [])
    }


def _claimed_slices(session: Session, ids: list) -> dict[tuple, int]:
    """(node, GPU) -> the memory slices its live MIG claims hold, as a bit mask."""
    held: dict[tuple, int] = {}
    for nid, gi, sl in session.execute(
        select(MigClaim.node_id, MigClaim.gpu_index, MigClaim.slice).where(
            MigClaim.node_id.in_(ids), MigClaim.released_at.is_(None)
        )
    ):
        held[(nid, gi)] = held.get((nid, gi), 0) | (1 << sl)
    return held


def _layout_history(
    session: Session, ids: list, now: datetime
) -> tuple[dict[tuple, datetime], Counter]:
    """Per (node, GPU): when its layout last changed, and how often in the last day."""
    since = now - timedelta(days=1)
    last: dict[tuple, datetime] = {}
    recent: Counter = Counter()
    for nid, gi, at in session.execute(
        select(MigRelayout.node_id, MigRelayout.gpu_index, MigRelayout.finished_at).where(
            MigRelayout.node_id.in_(ids), MigRelayout.status == "applied"
        )
    ):
        if at is None:
            continue
        at = at if at.tzinfo else at.replace(tzinfo=now.tzinfo)
        last[(nid, gi)] = max(last.get((nid, gi), at), at)
        recent[(nid, gi)] += at >= since
    return last, recent


def _coming_view(g: Gpu, node: str, r: MigRelayout, changes: int, now: datetime) -> GpuView:
    """A GPU with a layout asked and not yet made, as the planner sees it: as it will be."""
    target = tuple((k, int(st)) for k, st in r.layout) if r.mig_mode else None
    return GpuView(
        node=node,
        index=g.index,
        model=g.model,
        layout=target,
        idle=False,
        changed_at=now.timestamp(),
        changes_24h=changes + 1,
        free=target or (),
    )


def _current_view(
    g: Gpu, node: str, mask: int, busy: bool, changed_at: float, changes: int
) -> GpuView:
    """A GPU as it is laid out now, as the planner sees it: its free instances, and if idle."""
    layout = tuple((k, int(s)) for k, s in (g.mig_layout or [])) if g.mig_mode else None
    return GpuView(
        node=node,
        index=g.index,
        model=g.model,
        layout=layout,
        idle=not busy,
        changed_at=changed_at,
        changes_24h=changes,
        free=tuple(x for x in layout if not PROFILES[x[0]].mask(x[1]) & mask) if layout else (),
    )


def demand(session: Session, region: str, models: list[str]) -> Demand:
    """What waits in the region's queue, by class. Work that names no model counts for the
    region's most common one among the GPUs the planner sees."""
    whole: Counter = Counter()
    mig_: Counter = Counter()
    common = Counter(models).most_common(1)
    default = common[0][0] if common else ""
    for shape, replicas in session.execute(
        select(Workload.shape, Workload.replicas).where(
            Workload.region == region,
            Workload.state == State.queued.value,
            Workload.hold.is_(None),  # held back: no layout is made for it yet
        )
    ):
        model = next((m for m in shape.gpu_models if m in models), default)
        if shape.gpus:
            whole[model] += shape.gpus * replicas
        elif shape.mig_profile:
            mig_[(model, shape.mig_profile)] += replicas
    return Demand(whole=dict(whole), mig=dict(mig_))


def advance(session: Session, region: str, now: datetime, cfg: RelayoutConfig | None = None) -> int:
    """One look at the region: the planner's re-layouts asked of the agents. How many."""
    timed_out(session, now)
    gpus, nodes = views(session, region, now)
    if not gpus:
        return 0
    wanted = demand(session, region, [g.model for g in gpus])
    asked = 0
    for r in plan(gpus, wanted, cfg or RelayoutConfig(), now.timestamp()):
        node = nodes[r.node]
        try:
            with session.begin_nested():
                target = [tuple(x) for x in r.target] if r.target is not None else None
                mig.request(session, node, r.index, target, "demand")
        except AppError as exc:  # it got busy meanwhile, or its agent changed: next time
            log.info("mig_relayout_skipped", node=r.node, gpu=r.index, why=exc.detail)
            continue
        asked += 1
        log.info("mig_relayout_asked", node=r.node, gpu=r.index, reason=r.reason)
    return asked


def regions(session: Session) -> list[str]:
    """Regions with a node whose agent can lay out MIG (the beat's work list)."""
    if not get_settings().mig_relayout:
        return []
    return sorted(
        set(
            session.scalars(
                select(Region.name)
                .join(Rack, Rack.region_id == Region.id)
                .join(Node, Node.rack_id == Rack.id)
                .join(AgentNode, AgentNode.node_id == Node.id)
                .where(func.coalesce(Node.state, "") == NodeState.ready.value)
            )
        )
    )
