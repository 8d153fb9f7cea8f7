"""Why each queued workload of a region waits, as its placement cycle saw it (Slurm's squeue
REASON), written after the cycle in its transaction: only the reasons that changed.

The core says what blocked each workload it looked at (`CycleResult.blocked`): over its
tenant's limit, at its fair share, reserved (a start time), or no capacity. The edge refines
"no capacity" by what the region's nodes of the workload's models say (some out of service,
drifted from their software stack, being laid out again for MIG), since the core sees only the
nodes as they are. Work the cycle never reached waits behind work ahead of it (`Priority`);
work backing off after a restart waits for that (`BackOff`). Work held back before the cycle
(`Dependency`, `ArrayLimit`) has its reason written where it is held (app/workloads/holds.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import case, delete, select
from sqlalchemy.orm import Session

from app.core.db import as_aware, dialect_insert
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import PLACEABLE
from app.models.workloads import PendingReason, Workload
from app.scheduling.apply import CycleReport
from app.scheduling.world import (
    EPOCH,
    IS_QUEUED,
    Loaded,
    placed_runtime,
    process_pools,
    runtimes_offered,
)

REASONS = {
    "Resources": "no free capacity for it now",
    "Priority": "behind work ahead of it in the queue",
    "QuotaExhausted": "its tenant is at its limit",
    "FairShare": "its tenant is at its fair share while other tenants wait",
    "NodeNotReady": "the nodes that could hold it are out of service",
    "StackDrift": "the nodes that could hold it drifted from its software stack",
    "MigLayoutPending": "no GPU has a free instance of its MIG profile yet",
    "BackOff": "backing off after a restart",
    "Dependency": "waits for the workloads it depends on to succeed",
    "ArrayLimit": "its array has max_parallel elements under way",
    "RuntimeNotOffered": "no node that could hold it runs its runtime",
}
_PLACEABLE = frozenset(h.value for h in PLACEABLE)
NAMES = 3  # nodes named in a detail, at most


@dataclass
class _NodeState:
    name: str
    model: str
    out: str | None  # why it takes no work (its state or health), if so
    drifted: bool
    laying: bool
    runtimes: frozenset[str] | None  # what work may use there (None: anything; no agent)


def node_states(session: Session, region: str) -> list[_NodeState]:
    """The region's nodes (not retired), each with why it takes no work, if so; also read by
    a dry-run's `waits: ...` (app/workloads/regions.py `why_waiting`)."""
    rows = session.execute(
        select(
            Node.id,
            Node.name,
            Node.gpu_model,
            Node.state,
            Node.health,
            Node.drift,
            Node.agent_offers,
            Node.pool,
        )
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .where(Region.name == region, Node.state != "retired")
        .order_by(Node.name)
    ).all()
    laying = set(
        session.scalars(
            select(Gpu.node_id).where(
                Gpu.node_id.in_([r.id for r in rows]), Gpu.relayout_pending.is_(True)
            )
        )
    )
    pools = process_pools()
    return [
        _NodeState(
            name,
            model,
            state if state != "ready" else (health if health not in _PLACEABLE else None),
            bool(drift),
            nid in laying,
            runtimes_offered(offers, pool, pools),
        )
        for nid, name, model, state, health, drift, offers, pool in rows
    ]


def no_runtime(nodes: list[_NodeState], models: Iterable[str], need: str) -> str | None:
    """Why no node of these models could hold work that needs `need` (a runtime as
    `placed_runtime` names it), whatever their capacity, or None if one could."""
    wanted = set(models)
    mine = [n for n in nodes if not wanted or n.model in wanted]
    if not mine or any(n.runtimes is None or need in n.runtimes for n in mine):
        return None
    hint = ""
    if need.split("+")[0] == "process":
        hint = ", or the operator trusts none of their pools with it (RACKPLANE_PROCESS_POOLS)"
    return f"no node here runs {need} work: their agents do not offer it{hint}"


def _named(nodes: list[_NodeState], why: Iterable[str]) -> str:
    words = [f"{n.name} ({w})" for n, w in zip(nodes, why, strict=False)]
    more = f" and {len(nodes) - NAMES} more" if len(nodes) > NAMES else ""
    return ", ".join(words[:NAMES]) + more


def _no_capacity(w: Workload, nodes: list[_NodeState]) -> tuple[str, str]:
    """ "No capacity", said by what the nodes of its models show."""
    models = set(w.shape.gpu_models)
    need = placed_runtime(w.runtime, w.tier, bool(w.ssh_keys), w.volumes)
    none = no_runtime(nodes, models, need)
    if none is not None:
        return "RuntimeNotOffered", none
    mine = [n for n in nodes if not models or n.model in models]
    if w.shape.mig_profile:
        laying = [n for n in mine if n.laying and n.out is None]
        if laying:
            return "MigLayoutPending", "MIG layouts being made on " + _named(
                laying, ["laying out"] * len(laying)
            )
    out = [n for n in mine if n.out is not None]
    if out:
        return "NodeNotReady", "no capacity on the nodes taking work; out: " + _named(
            out, [n.out or "" for n in out]
        )
    if w.stack:
        drifted = [n for n in mine if n.drifted]
        if drifted:
            return "StackDrift", f"nodes of stack {w.stack} drifted: " + _named(
                drifted, ["drifted"] * len(drifted)
            )
    if w.shape.mig_profile:
        return "MigLayoutPending", (
            f"no GPU has a free {w.shape.mig_profile} instance; agents' nodes are laid out "
            "again as waiting work asks"
        )
    return "Resources", REASONS["Resources"]


def _blocked(w: Workload, why: str | None, nodes: list[_NodeState] | None) -> tuple[str, str]:
    if why is None:
        return "Priority", REASONS["Priority"]
    if why == "over its tenant's limit":
        return "QuotaExhausted", REASONS["QuotaExhausted"]
    if why.startswith("at its fair share"):
        return "FairShare", REASONS["FairShare"]
    if why.startswith("reserved from t="):
        at = EPOCH + timedelta(seconds=float(why.split("=", 1)[1]))
        return "Resources", f"GPUs are held for it from {at:%Y-%m-%d %H:%M:%S} UTC"
    assert nodes is not None
    return _no_capacity(w, nodes)


def record(
    session: Session, region: str, loaded: Loaded | None, report: CycleReport, now: datetime
) -> int:
    """Write why each of the region's queued workloads waits after this cycle (those placed
    lose theirs); returns how many rows were written."""
    admitted = set(report.admitted)
    waiting: dict[uuid.UUID, tuple[Workload | None, uuid.UUID, str, str]] = {}
    nodes: list[_NodeState] | None = None
    for w in loaded.queued if loaded is not None else []:
        if str(w.id) in admitted:
            continue
        why = report.blocked.get(str(w.id))
        if why is not None and why.startswith("no capacity") and nodes is None:
            nodes = node_states(session, region)
        reason, detail = _blocked(w, why, nodes)
        waiting[w.id] = (w, w.tenant_id, reason, detail)
    # Backing off after a restart: not in the cycle's queue at all.
    for wid, tenant, until in session.execute(
        select(Workload.id, Workload.tenant_id, Workload.not_before).where(
            Workload.region == region, IS_QUEUED, Workload.not_before > now
        )
    ):
        waiting[wid] = (
            None,
            tenant,
            "BackOff",
            f"backing off after a restart until {as_aware(until):%Y-%m-%d %H:%M:%S} UTC",
        )
    if admitted:  # placed: they wait no more (one statement, whether they had a row or not)
        session.execute(
            delete(PendingReason).where(
                PendingReason.workload_id.in_([uuid.UUID(a) for a in admitted])
            )
        )
    return write(
        session,
        [(wid, tenant, reason, detail) for wid, (_w, tenant, reason, detail) in waiting.items()],
        now,
    )


def write(
    session: Session, reasons: list[tuple[uuid.UUID, uuid.UUID, str, str]], now: datetime
) -> int:
    """Set why these workloads (id, tenant, reason, detail) wait: the rows that changed only,
    in one statement (a reason that stays keeps its `since`); returns how many were written."""
    if not reasons:
        return 0
    have = {
        r.workload_id: (r.reason, r.detail)
        for r in session.execute(
            select(PendingReason.workload_id, PendingReason.reason, PendingReason.detail).where(
                PendingReason.workload_id.in_([r[0] for r in reasons])
            )
        )
    }
    rows = [
        {
            "workload_id": wid,
            "tenant_id": tenant,
            "reason": reason,
            "detail": detail[:300],
            "since": now,
            "seen_at": now,
        }
        # In key order: two cycles writing rows of one workload lock them in one order.
        for wid, tenant, reason, detail in sorted(reasons, key=lambda r: r[0])
        if have.get(wid) != (reason, detail[:300])
    ]
    if rows:
        t = PendingReason.__table__
        ins = dialect_insert(session, PendingReason)
        session.execute(
            ins.on_conflict_do_update(
                index_elements=["workload_id"],
                set_={
                    "reason": ins.excluded.reason,
                    "detail": ins.excluded.detail,
                    "seen_at": ins.excluded.seen_at,
                    "since": case(
                        (t.c.reason == ins.excluded.reason, t.c.since), else_=ins.excluded.since
                    ),
                },
            ),
            rows,
        )
    return len(rows)


def reasons_of(session: Session, ids: list[uuid.UUID]) -> dict[uuid.UUID, PendingReason]:
    """The pending reasons of these workloads (one read for a page)."""
    if not ids:
        return {}
    return {
        r.workload_id: r
        for r in session.scalars(select(PendingReason).where(PendingReason.workload_id.in_(ids)))
    }
