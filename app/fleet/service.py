"""Fleet writes: applying a validated fleet document, node state changes, capacity."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.orm import Session, selectinload

from app.core.db import get_or_404, new_id, utcnow
from app.core.errors import Conflict
from app.core.schemas import paginate
from app.fleet.schemas import GpuOut, NodeOut
from app.models.agents import AgentNode
from app.models.fleet import AWAITING_AGENT, FleetImport, Gpu, Node, NodeState, Rack, Region
from app.models.health import PLACEABLE, Health
from app.models.workloads import Allocation, GpuUsage, MigClaim
from app.outbox.service import enqueue
from app.placement.catalog import RACK_KINDS
from app.placement.mig import PROFILES, free_starts, profile_name
from app.workloads.disruptions import node_state_changed
from app.workloads.regions import forget_regions

# Allowed operator transitions of a node's state.
NODE_TRANSITIONS: dict[str, set[str]] = {
    NodeState.ready.value: {"cordoned", "draining", "down", "retired"},
    NodeState.cordoned.value: {"ready", "draining", "down", "retired"},
    NodeState.draining.value: {"cordoned", "ready", "down", "retired"},
    NodeState.down.value: {"ready", "cordoned", "retired"},
    NodeState.retired.value: set(),  # for good
    NodeState.validating.value: {"ready", "cordoned", "down", "retired"},
}


class FleetConflict(Conflict):
    code = "fleet_conflict"


def _existing_nodes(session: Session, doc: dict[str, Any]) -> dict[str, Node]:
    names = [n["name"] for reg in doc["regions"] for r in reg["racks"] for n in r["nodes"]]
    existing: dict[str, Node] = {}
    for chunk in range(0, len(names), 1000):
        for node in session.scalars(select(Node).where(Node.name.in_(names[chunk : chunk + 1000]))):
            existing[node.name] = node
    return existing


def conflicts(session: Session, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What applying a valid document would refuse, against the fleet as it is now: a rack
    that exists as another kind, a node that exists in another rack or with another GPU model.
    Each problem names its field as validation does (`regions[0].racks[1].nodes[0].name`).
    The dry run, the import request and the import itself all ask this one question."""
    existing = _existing_nodes(session, doc)
    racks = {
        (region, rack): (rack_id, kind)
        for rack_id, kind, rack, region in session.execute(
            select(Rack.id, Rack.kind, Rack.name, Region.name).join(
                Region, Rack.region_id == Region.id
            )
        )
    }
    where = {rack_id: f"{region}/{rack}" for (region, rack), (rack_id, _) in racks.items()}
    found: list[dict[str, Any]] = []

    def problem(field: str, message: str) -> None:
        found.append({"field": field, "line": None, "column": None, "message": message})

    for ri, reg in enumerate(doc["regions"]):
        for ki, rk in enumerate(reg["racks"]):
            at = f"regions[{ri}].racks[{ki}]"
            rack_id, kind = racks.get((reg["name"], rk["name"]), (None, None))
            if kind is not None and kind != rk["kind"]:
                problem(
                    f"{at}.kind",
                    f"rack {reg['name']}/{rk['name']} exists as {kind}, the file says {rk['kind']}",
                )
            for ni, nd in enumerate(rk["nodes"]):
                node = existing.get(nd["name"])
                if node is None:
                    continue
                if node.rack_id != rack_id:
                    problem(
                        f"{at}.nodes[{ni}].name",
                        f"node {nd['name']} already exists in rack {where.get(node.rack_id)}",
                    )
                elif node.gpu_model != nd["gpu_model"]:
                    problem(
                        f"{at}.nodes[{ni}].gpu_model",
                        f"node {nd['name']} exists with {node.gpu_model} GPUs, the file says "
                        f"{nd['gpu_model']}",
                    )
    return found


def refuse_conflicts(session: Session, doc: dict[str, Any]) -> None:
    """FleetConflict listing every conflict (see `conflicts`), if there is any."""
    found = conflicts(session, doc)
    if found:
        raise FleetConflict(
            f"The fleet file conflicts with the fleet in {len(found)} place(s): "
            + "; ".join(f"{p['field']}: {p['message']}" for p in found[:5])
            + ("; …" if len(found) > 5 else "")
            + ". Nothing was imported.",
            errors=found,
        )


def queue_import(session: Session, doc: dict[str, Any], source: str | None) -> FleetImport:
    """Store a validated fleet document for a worker to apply (`apply_document`)."""
    imp = FleetImport(document=doc, source=source, created_at=utcnow())
    session.add(imp)
    session.flush()
    enqueue(session, "fleet.import", queue="fleet", import_id=str(imp.id))
    return imp


def apply_document(session: Session, doc: dict[str, Any]) -> dict[str, int]:
    """Apply a validated, normalised fleet document (see `app.fleet.document`).

    Additive and idempotent: objects matched by name are kept (CPU/memory updated); new ones
    are created. A conflict with what exists (a rack of another kind, a node in another rack
    or of another model: `conflicts`) raises FleetConflict and the caller's transaction
    writes nothing.
    """
    refuse_conflicts(session, doc)
    created = {"regions": 0, "racks": 0, "nodes": 0, "gpus": 0}
    updated = 0
    existing_nodes = _existing_nodes(session, doc)
    regions = {r.name: r for r in session.scalars(select(Region))}
    now = utcnow()
    new_gpus: list[dict[str, Any]] = []
    for reg in doc["regions"]:
        region = _region_for(session, regions, reg["name"], now, created)
        racks = {
            r.name: r for r in session.scalars(select(Rack).where(Rack.region_id == region.id))
        }
        for rk in reg["racks"]:
            rack = _rack_for(session, racks, region, rk, now, created)
            domain_of_rack = RACK_KINDS[rk["kind"]].rack_is_nvlink_domain
            for nd in rk["nodes"]:
                node = existing_nodes.get(nd["name"])
                if node is not None:  # in this rack with this model: `conflicts` checked
                    updated += _update_node(node, nd)
                    continue
                domain = (
                    f"{reg['name']}/{rk['name']}"
                    if domain_of_rack
                    else f"{reg['name']}/{rk['name']}/{nd['name']}"
                )
                node = _add_node(session, rack, nd, domain, now)
                created["nodes"] += 1
                new_gpus += _gpu_rows(node, nd, now)
    if new_gpus:
        for g in new_gpus:
            g["id"] = new_id()
        session.execute(Gpu.__table__.insert(), new_gpus)
        created["gpus"] = len(new_gpus)

    forget_regions()
    return {**{f"created_{k}": v for k, v in created.items()}, "updated_nodes": updated}


def _region_for(
    session: Session, regions: dict[str, Region], name: str, now: datetime, created: dict[str, int]
) -> Region:
    """The region of this name, created (and counted) if the fleet has none yet."""
    region = regions.get(name)
    if region is None:
        region = Region(name=name, created_at=now)
        session.add(region)
        session.flush()
        regions[name] = region
        created["regions"] += 1
    return region


def _rack_for(
    session: Session,
    racks: dict[str, Rack],
    region: Region,
    rk: dict[str, Any],
    now: datetime,
    created: dict[str, int],
) -> Rack:
    """The region's rack of the document's name, created (and counted) if it has none yet."""
    rack = racks.get(rk["name"])
    if rack is None:
        rack = Rack(
            region_id=region.id,
            name=rk["name"],
            kind=rk["kind"],
            block=rk["block"],
            created_at=now,
        )
        session.add(rack)
        session.flush()
        created["racks"] += 1
    return rack


def _update_node(node: Node, nd: dict[str, Any]) -> int:
    """An existing node's CPU, memory and pool set as the document says; how many changed."""
    updated = 0
    if (node.cpu_milli, node.memory_mib) != (nd["cpu_milli"], nd["memory_mib"]):
        node.cpu_milli, node.memory_mib = nd["cpu_milli"], nd["memory_mib"]
        node.generation += 1
        updated += 1
    if nd.get("pool") and node.pool != nd["pool"]:
        node.pool = nd["pool"]
        updated += 1
    return updated


def _add_node(session: Session, rack: Rack, nd: dict[str, Any], domain: str, now: datetime) -> Node:
    """A new node of the document in `rack`, in NVLink domain `domain`, flushed (its id)."""
    node = Node(
        rack_id=rack.id,
        name=nd["name"],
        gpu_model=nd["gpu_model"],
        cpu_milli=nd["cpu_milli"],
        memory_mib=nd["memory_mib"],
        state=nd["state"],
        pool=nd.get("pool"),
        nvlink_domain=domain,
        generation=0,
        created_at=now,
    )
    if nd.get("agent"):
        # Meant for an agent: no work until it has joined and passed bring-up
        # (app/agents/inventory.py `bring_up`).
        node.health = Health.validating.value
        node.health_reason = AWAITING_AGENT
        node.health_since = now
    session.add(node)
    session.flush()
    return node


def _gpu_rows(node: Node, nd: dict[str, Any], now: datetime) -> list[dict[str, Any]]:
    """The rows of a new node's GPUs, for one bulk insert (their ids are added there)."""
    mig = set(nd["mig_gpus"])
    return [
        {
            "node_id": node.id,
            "index": i,
            "model": nd["gpu_model"],
            "mig_mode": i in mig,
            "health": Health.healthy.value,
            "created_at": now,
        }
        for i in range(nd["gpus"])
    ]


def set_node_state(node: Node, state: str, reason: str | None) -> Node:
    if state == node.state:
        node.state_reason = reason if reason is not None else node.state_reason
        return node
    if state not in NODE_TRANSITIONS[node.state]:
        raise Conflict(
            f"A {node.state} node cannot become {state}; allowed: "
            f"{', '.join(sorted(NODE_TRANSITIONS[node.state]))}.",
            code="invalid_state_transition",
        )
    node.state = state
    node.state_reason = reason
    node.generation += 1
    return node


def capacity(session: Session) -> list[dict[str, Any]]:
    """Per region and GPU model, what is free now, net of every live allocation: whole GPUs
    (nothing on them), fractional capacity (milli-GPU left on GPUs not in MIG mode), and per
    MIG profile how many more instances the MIG GPUs could take. Only GPUs that can take
    work count as free: on a ready node, both healthy or suspect (app/health/states.py)."""
    placeable = [h.value for h in PLACEABLE]
    usable = and_(
        Node.state == NodeState.ready.value,
        Node.health.in_(placeable),
        Gpu.health.in_(placeable),
        Gpu.relayout_pending.is_(False),  # being laid out again: no work until its agent reports
    )
    rows = _whole_and_fractional(session, usable)
    # MIG GPUs: their layout from the live claims (memory slices) and allocations (compute).
    # An agent's GPU has the instances its agent reported and no others (placement puts MIG
    # work only on those: app/scheduling/world.py); a simulated one any that fit.
    mig_gpus = session.execute(
        select(
            Region.name,
            Gpu.model,
            Gpu.node_id,
            Gpu.index,
            Gpu.mig_layout,
            AgentNode.node_id.is_not(None),
        )
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .outerjoin(AgentNode, AgentNode.node_id == Node.id)
        .where(usable, Gpu.mig_mode.is_(True))
    ).all()
    if not mig_gpus:
        return list(rows.values())
    masks = _claimed_slices(session)
    held = _mig_compute_held(session)
    for region, model, node, index, layout, agent in mig_gpus:
        free = rows[(region, model)]["free_mig"]
        mask = masks.get((node, index), 0)
        if layout is not None or agent:
            for key, start in layout or []:
                if not PROFILES[key].mask(int(start)) & mask:
                    name = profile_name(model, key)
                    free[name] = free.get(name, 0) + 1
            continue
        _count_fitting(free, model, mask, *held.get((node, index), (0, 0)))
    return list(rows.values())


def _whole_and_fractional(session: Session, usable: Any) -> dict[tuple, dict[str, Any]]:
    """(region, model) -> its row of `capacity`: GPUs, whole free GPUs and free milli-GPU."""
    used = func.coalesce(GpuUsage.milli_used, 0)
    whole = and_(usable, Gpu.mig_mode.is_(False))
    stmt = (
        select(
            Region.name,
            Gpu.model,
            func.count(Gpu.id),
            func.sum(case((and_(whole, used == 0), 1), else_=0)),
            func.sum(case((whole, 1000 - used), else_=0)),
        )
        .select_from(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .outerjoin(GpuUsage, and_(GpuUsage.node_id == Gpu.node_id, GpuUsage.gpu_index == Gpu.index))
        .where(Node.state != NodeState.retired.value)  # no longer part of the fleet
        .group_by(Region.name, Gpu.model)
        .order_by(Region.name, Gpu.model)
    )
    return {
        (r, m): {
            "region": r,
            "gpu_model": m,
            "total_gpus": int(t),
            "free_gpus": int(f or 0),
            "free_milli": int(fm or 0),
            "free_mig": {},
        }
        for r, m, t, f, fm in session.execute(stmt)
    }


def _claimed_slices(session: Session) -> dict[tuple, int]:
    """(node, GPU) -> the memory slices its live MIG claims hold, as a bit mask."""
    masks: dict[tuple, int] = {}
    for node, index, slice_ in session.execute(
        select(MigClaim.node_id, MigClaim.gpu_index, MigClaim.slice).where(
            MigClaim.released_at.is_(None)
        )
    ):
        masks[(node, index)] = masks.get((node, index), 0) | (1 << slice_)
    return masks


def _mig_compute_held(session: Session) -> dict[tuple, list[int]]:
    """(node, GPU) -> [compute slices used, instances] of its live MIG allocations."""
    held: dict[tuple, list[int]] = {}
    for node, gpus, profile in session.execute(
        select(Allocation.node_id, Allocation.gpu_indices, Allocation.mig_profile).where(
            Allocation.released_at.is_(None), Allocation.mig_profile.is_not(None)
        )
    ):
        for g in gpus:
            h = held.setdefault((node, g), [0, 0])
            h[0] += PROFILES[profile].compute
            h[1] += 1
    return held


def _count_fitting(
    free: dict[str, int], model: str, mask: int, compute: int, instances: int
) -> None:
    """Add to `free`, per profile, how many more instances a simulated MIG GPU could take."""
    for key, profile in PROFILES.items():
        n, m, c, i = 0, mask, compute, instances
        while starts := free_starts(profile, m, c, i):
            m, c, i, n = m | profile.mask(starts[0]), c + profile.compute, i + 1, n + 1
        if n:
            name = profile_name(model, key)
            free[name] = free.get(name, 0) + n


def holders(session: Session, node_ids: list) -> dict[tuple, list[dict[str, Any]]]:
    """(node id, GPU index) -> the live allocations on that GPU (operators' views)."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    A = Allocation
    for a in session.execute(  # rows, not objects: a page of nodes holds hundreds
        select(
            A.node_id,
            A.gpu_indices,
            A.workload_id,
            A.tenant_id,
            A.replica,
            A.tier,
            A.milli,
            A.gpu_memory_mib,
            A.mig_profile,
            A.mig_start,
            Node.gpu_model,
        )
        .join(Node, Node.id == A.node_id)
        .where(A.node_id.in_(node_ids), A.released_at.is_(None))
        .order_by(A.created_at)
    ):
        for g in a.gpu_indices:
            out.setdefault((a.node_id, g), []).append(
                {
                    "workload_id": a.workload_id,
                    "tenant_id": a.tenant_id,
                    "replica": a.replica,
                    "tier": a.tier,
                    "milli": a.milli,
                    "gpu_memory_mib": a.gpu_memory_mib,
                    "mig_profile": profile_name(a.gpu_model, a.mig_profile)
                    if a.mig_profile
                    else None,
                    "mig_slot": a.mig_start,
                }
            )
    return out


def gpu_detail(gpu: Gpu, held: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **GpuOut.model_validate(gpu).model_dump(),
        "holders": held,
        "free_milli": max(0, 1000 - sum(h["milli"] for h in held)),
    }


def node_detail(session: Session, node: Node) -> dict[str, Any]:
    """A node with its GPUs, each with who holds it (operators' view)."""
    session.scalars(select(Node).where(Node.id == node.id).options(selectinload(Node.gpus))).one()
    held = holders(session, [node.id])
    return {
        **NodeOut.model_validate(node).model_dump(),
        "gpus": [gpu_detail(g, held.get((node.id, g.index), [])) for g in node.gpus],
    }


def list_gpus(
    session: Session, page: Any, *, node_id: str | None = None
) -> tuple[list[Gpu], str | None]:
    """GPUs, oldest first; on one node (by id) if asked (NotFound if there is none)."""
    stmt = select(Gpu)
    if node_id:
        stmt = stmt.where(Gpu.node_id == get_or_404(session, Node, node_id, what="node").id)
    return paginate(session, stmt, Gpu, page)


def list_nodes(
    session: Session,
    page: Any,
    *,
    rack_id: str | None = None,
    state: str | None = None,
    gpu_model: str | None = None,
    name: str | None = None,
) -> tuple[list[Node], str | None]:
    """Nodes, oldest first, a page at a time (operators: REST's list, GraphQL's connection)."""
    stmt = select(Node)
    if rack_id:
        stmt = stmt.where(Node.rack_id == get_or_404(session, Rack, rack_id, what="rack").id)
    if state is not None:
        stmt = stmt.where(Node.state == state)
    if gpu_model:
        stmt = stmt.where(Node.gpu_model == gpu_model)
    if name:
        stmt = stmt.where(Node.name == name)
    return paginate(session, stmt, Node, page)


def change_node_state(session: Session, node: Node, state: str, reason: str | None) -> Node:
    """An operator's cordon, drain, down or return to ready, and what it does to the work on
    the node."""
    before = node.state
    set_node_state(node, state, reason)
    session.flush()
    if node.state != before:
        node_state_changed(session, node.id, node.name, node.state)
    return node


def list_regions(session: Session, page: Any) -> tuple[list[Region], str | None]:
    return paginate(session, select(Region), Region, page)


def list_racks(
    session: Session, page: Any, *, region_id: str | None = None
) -> tuple[list[Rack], str | None]:
    """Racks, oldest first; in one region (by id) if asked (NotFound if there is none)."""
    stmt = select(Rack)
    if region_id:
        stmt = stmt.where(
            Rack.region_id == get_or_404(session, Region, region_id, what="region").id
        )
    return paginate(session, stmt, Rack, page)
