"""What operators see: the fleet's health by region and rack (what is out and why, open
incidents, what the circuit breaker held back), and a node's or GPU's history."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import utcnow
from app.health import states
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import HealthEvent, HealthIncident, IncidentState
from app.models.workloads import GpuUsage


def summary(session: Session) -> dict[str, Any]:
    """Per region and rack: GPUs by health state and by allocation, and what is out and why;
    open incidents; what the circuit breaker held back within its window."""
    s = get_settings()
    regions = _regions(_gpu_rows(session))
    since = utcnow() - timedelta(seconds=s.breaker_window_seconds)
    return {
        "regions": [{**r, "racks": list(r["racks"].values())} for r in regions.values()],
        "incidents": _incidents(session, since),
    }


def _gpu_rows(session: Session) -> list[Row]:
    """Every GPU of a node in service, with its node's and its own health and its use."""
    return list(
        session.execute(
            select(
                Region.name,
                Rack.name,
                Node.name,
                Node.state,
                Node.health,
                Node.health_reason,
                Node.health_since,
                Gpu.index,
                Gpu.health,
                Gpu.health_reason,
                Gpu.health_since,
                func.coalesce(GpuUsage.milli_used, 0),
            )
            .select_from(Gpu)
            .join(Node, Gpu.node_id == Node.id)
            .join(Rack, Node.rack_id == Rack.id)
            .join(Region, Rack.region_id == Region.id)
            .outerjoin(
                GpuUsage, (GpuUsage.node_id == Gpu.node_id) & (GpuUsage.gpu_index == Gpu.index)
            )
            .where(Node.state != "retired")
            .order_by(Region.name, Rack.name, Node.name, Gpu.index)
        ).all()
    )


def _regions(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """The GPUs counted per region and rack, by health and by allocation, with what is out."""
    placeable = {h.value for h in states.PLACEABLE}
    regions: dict[str, dict[str, Any]] = {}
    seen_nodes: set[str] = set()
    for (
        region,
        rack,
        node,
        nstate,
        nhealth,
        nreason,
        nsince,
        index,
        ghealth,
        greason,
        gsince,
        used,
    ) in rows:
        reg = regions.setdefault(
            region,
            {"region": region, "gpus": 0, "by_health": {}, "by_allocation": _alloc0(), "racks": {}},
        )
        rk = reg["racks"].setdefault(
            rack, {"rack": rack, "gpus": 0, "by_health": {}, "by_allocation": _alloc0(), "out": []}
        )
        # A GPU's effective state: its node's when the node is out.
        health = ghealth if nhealth in placeable else nhealth
        usable = nstate == "ready" and nhealth in placeable and ghealth in placeable
        alloc = "allocated" if used > 0 else "idle" if usable else "unavailable"
        for agg in (reg, rk):
            agg["gpus"] += 1
            agg["by_health"][health] = agg["by_health"].get(health, 0) + 1
            agg["by_allocation"][alloc] += 1
        if nhealth not in placeable and node not in seen_nodes:
            seen_nodes.add(node)
            rk["out"].append(
                {
                    "node": node,
                    "gpu_index": None,
                    "health": nhealth,
                    "reason": nreason,
                    "since": nsince,
                }
            )
        elif nhealth in placeable and ghealth != "healthy":
            rk["out"].append(
                {
                    "node": node,
                    "gpu_index": index,
                    "health": ghealth,
                    "reason": greason,
                    "since": gsince,
                }
            )
    return regions


def _incidents(session: Session, since: datetime) -> list[dict[str, Any]]:
    """Open incidents, and those opened since `since` (the breaker's window), newest first."""
    incidents = session.scalars(
        select(HealthIncident)
        .where((HealthIncident.state == IncidentState.open) | (HealthIncident.opened_at >= since))
        .order_by(HealthIncident.opened_at.desc())
        .limit(200)
    ).all()
    names: dict[uuid.UUID, str] = {}
    if incidents:
        ids = {i.node_id for i in incidents}
        names = {
            k: v for k, v in session.execute(select(Node.id, Node.name).where(Node.id.in_(ids)))
        }
    return [
        {
            "id": i.id,
            "node": names.get(i.node_id),
            "region": i.region,
            "state": i.state,
            "opened_at": i.opened_at,
            "last_signal_at": i.last_signal_at,
            "signal": i.signal,
            "xid": i.code if i.signal == "xid" else None,
            "action": i.action,
            "what": i.what,
            "gpu_indices": i.gpu_indices,
            "signals": i.signal_count,
            "held_back": i.held_back,
        }
        for i in incidents
    ]


def _alloc0() -> dict[str, int]:
    return {"allocated": 0, "idle": 0, "unavailable": 0}


def history(session: Session, node: Node, gpu_index: int | None, limit: int) -> list[HealthEvent]:
    """A node's (or one of its GPUs') health transitions, newest first."""
    stmt = select(HealthEvent).where(HealthEvent.node_id == node.id)
    if gpu_index is not None:
        stmt = stmt.where(HealthEvent.gpu_index == gpu_index)
    return list(session.scalars(stmt.order_by(HealthEvent.id.desc()).limit(limit)))
