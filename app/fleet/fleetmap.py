"""The fleet as cells for the operators' heatmap: every region, rack, node and GPU in one compact
answer (a 100k-GPU fleet is four reads of rows, no objects, and one string of a character per
GPU), so the page draws it from one request rather than one per rack."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.workloads import Allocation as A

# One character per GPU: what the cell shows, first match wins (health before work: a bad GPU
# is news even with work on it; a down node's GPUs can hold nothing).
LEGEND: list[tuple[str, str, str]] = [
    (
        "Q",
        "quarantined",
        "Out of the pool by the health loop: quarantined, draining, repairing or out of service",
    ),
    ("A", "validating", "Repaired and being validated before it returns to the pool: no new work"),
    ("S", "suspect", "Healthy enough to run, kept last for new work and away from gangs"),
    ("X", "down", "Its node is down, retired or unreachable"),
    ("D", "dedicated", "Allocated: a whole GPU (container)"),
    ("V", "vm", "Allocated: a VM with the GPU passed through"),
    ("C", "confidential-vm", "Allocated: a confidential VM"),
    ("M", "mig-dedicated", "Allocated: MIG slices, one tenant's"),
    ("m", "mig-shared", "Allocated: MIG slices shared between tenants"),
    ("F", "mps", "Allocated: fractional shares (MPS)"),
    ("T", "timeslice", "Allocated: time-sliced shares"),
    ("K", "cordoned", "Idle on a cordoned or draining node: no new work lands here"),
    ("P", "mig-idle", "In MIG mode with no slice held"),
    (".", "idle", "Ready, healthy, nothing on it"),
]
_TIER = {name: code for code, name, _ in LEGEND}
_OUT = {"quarantined", "repairing", "out_of_service", "draining"}
_HEALTH = {"Q", "A"}  # health codes: shown whatever the node's state or the work on the GPU
NODE_CODES = {"ready": "r", "cordoned": "c", "draining": "d", "down": "x", "retired": "t"}


def _in_region(stmt: Any, node_id: Any, region: str | None) -> Any:
    """`stmt` narrowed to the nodes of `region` (by joins, not a list of ids)."""
    if region is None:
        return stmt
    if node_id is not Node.id:
        stmt = stmt.join(Node, Node.id == node_id)
    return (
        stmt.join(Rack, Rack.id == Node.rack_id)
        .join(Region, Region.id == Rack.region_id)
        .where(Region.name == region)
    )


def _gpu_codes(session: Session, region: str | None) -> dict[Any, str]:
    """Per node, one character per GPU in index order from its health and MIG mode alone
    (`Q`, `A`, `S`, `P` or `.`). Most GPUs are healthy and whole: the database counts each node's
    GPUs and returns only the others (two index-friendly reads, not 100,000 rows)."""
    code = case(
        (Gpu.health == "validating", "A"),
        (Gpu.health.in_(sorted(_OUT)), "Q"),
        (Gpu.health == "suspect", "S"),
        (Gpu.mig_mode.is_(True), "P"),
        else_=".",
    )
    counts = select(Gpu.node_id, func.count()).group_by(Gpu.node_id)
    odd = select(Gpu.node_id, Gpu.index, code).where(
        or_(Gpu.health != "healthy", Gpu.mig_mode.is_(True))
    )
    counts, odd = _in_region(counts, Gpu.node_id, region), _in_region(odd, Gpu.node_id, region)
    conn = session.connection()
    cells = {node_id: ["."] * n for node_id, n in conn.execute(counts).all()}
    for node_id, index, c in conn.execute(odd).all():
        cells[node_id][index] = c
    return {k: "".join(v) for k, v in cells.items()}


def _node_codes(codes: str, state: str, health: str, held: dict[int, str]) -> str:
    """A node's GPU characters with its state, its own health and the work on it laid over
    (see LEGEND): a node out of the pool (repairing, quarantined...) or validating takes its
    GPUs with it, as the Health page and Lifecycle say, whatever the GPUs' own health."""
    down = state in ("down", "retired") or health == "unreachable"
    closed = state in ("cordoned", "draining")
    node_out = "Q" if health in _OUT else "A" if health == "validating" else None
    if not (down or closed or held or node_out):
        return codes
    out = list(codes)
    for i, c in enumerate(out):
        if c in _HEALTH:
            continue
        if down:
            out[i] = "X"
        elif node_out is not None:
            out[i] = node_out
        elif c != "S" and i in held:
            out[i] = held[i]
        elif closed and c in ".P":
            out[i] = "K"
    return "".join(out)


def fleet_map(session: Session, region: str | None = None) -> dict[str, Any]:
    """Regions, racks (each with its consecutive run of nodes), nodes (names, states, models,
    GPU counts) and one character per GPU in that order; MIG GPUs' layouts beside."""
    rack_stmt = (
        select(Rack.id, Rack.name, Rack.kind, Rack.block, Region.name.label("region"))
        .join(Region, Region.id == Rack.region_id)
        .order_by(Region.name, Rack.name)
    )
    if region is not None:
        rack_stmt = rack_stmt.where(Region.name == region)
    conn = session.connection()  # rows through Core: no ORM row processing
    racks = conn.execute(rack_stmt).all()
    node_stmt = _in_region(
        select(Node.id, Node.rack_id, Node.name, Node.state, Node.health, Node.gpu_model),
        Node.id,
        region,
    ).order_by(Node.rack_id, Node.name)
    by_rack: dict[Any, list[Any]] = {}
    for n in conn.execute(node_stmt).all():  # one fetch, not a round of fetchone per row
        by_rack.setdefault(n.rack_id, []).append(n)
    gpus = _gpu_codes(session, region)

    held: dict[Any, dict[int, str]] = {}  # node -> GPU index -> the first holder's tier
    mig: dict[tuple[Any, int], list[str]] = {}
    live = select(A.node_id, A.gpu_indices, A.tier, A.mig_profile, A.mig_start).where(
        A.released_at.is_(None)
    )
    for a in conn.execute(_in_region(live, A.node_id, region).order_by(A.created_at)):
        for i in a.gpu_indices:
            held.setdefault(a.node_id, {}).setdefault(i, _TIER.get(a.tier, "D"))
            if a.mig_profile:
                mig.setdefault((a.node_id, i), []).append(f"{a.mig_profile}@{a.mig_start}")

    regions: list[str] = []
    models: list[str] = []
    out_racks, names, states, node_models, counts, cells, layouts = [], [], [], [], [], [], []
    offset = 0
    model_at: dict[str, int] = {}
    for r in racks:
        if not regions or regions[-1] != r.region:
            regions.append(r.region)
        nodes = by_rack.get(r.id, [])
        out_racks.append(
            {
                "name": r.name,
                "region": len(regions) - 1,
                "kind": r.kind,
                "block": r.block,
                "nodes": len(nodes),
            }
        )
        for n in nodes:
            if n.gpu_model not in model_at:
                model_at[n.gpu_model] = len(models)
                models.append(n.gpu_model)
            names.append(n.name)
            states.append(NODE_CODES.get(n.state, "r"))
            node_models.append(model_at[n.gpu_model])
            codes = _node_codes(gpus.get(n.id, ""), n.state, n.health, held.get(n.id, {}))
            counts.append(len(codes))
            for i, c in enumerate(codes if "P" in codes or n.id in held else ""):
                if c == "P" or (n.id, i) in mig:
                    layout = ",".join(sorted(mig.get((n.id, i), [])))
                    layouts.append({"gpu": offset + i, "layout": layout})
            offset += len(codes)
            cells.append(codes)
    return {
        "generated_at": utcnow(),
        "regions": regions,
        "racks": out_racks,
        "models": models,
        "nodes": names,
        "node_states": "".join(states),
        "node_models": node_models,
        "gpu_counts": counts,
        "gpus": "".join(cells),
        "mig": layouts,
        "legend": [{"code": c, "name": n, "description": d} for c, n, d in LEGEND],
    }
