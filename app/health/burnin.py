"""Burn-in outcomes: the agent's report judged, and the node moved.

Every step passed (or was skipped for want of its tool): the node is back in service (its
repair done) and, the first time, in production (`Node.production_at`). A step failed, timed
out, or the whole burn-in ran past its limit: the failure is named (step, GPU, why) on the
node; a first failure since the node last passed sends it to repair (a reboot), a second one
out of service for an RMA.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware
from app.health import suite
from app.health.repairs import return_to_service, start_repair
from app.health.schemas import BringUp, BringUpNode
from app.health.transitions import H, Where, move, where
from app.models.agents import AgentNode
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import BurnIn, HealthRepair, NodeHeartbeat
from app.models.workloads import Allocation
from app.outbox.service import enqueue
from app.scheduling import lifecycle
from app.workloads.queueing import kick_placement
from rackplane_wire import BurnInReport


def take(session: Session, node_id: uuid.UUID, report: BurnInReport, now: datetime) -> bool:
    """An agent's report on its node's burn-in; True when it was news."""
    return take_many(session, [(node_id, report)], now)[0]


def take_many(
    session: Session, reports: list[tuple[uuid.UUID, BurnInReport]], now: datetime
) -> list[bool]:
    """Agents' reports on their nodes' burn-ins, in one transaction (a fleet's bring-up sends a
    thousand at once): each whether it was news. The nodes of the finished ones, then the
    burn-ins, are read and locked in one statement each (in id order), and their racks' names
    in one, so that the changes are written together at the flush instead of a few round
    trips per node."""
    ids: list[uuid.UUID | None] = []
    for _, report in reports:
        try:
            ids.append(uuid.UUID(report.id))
        except ValueError:
            ids.append(None)
    # Nodes first, then their burn-ins, as every path that locks both does (a burn-in starts
    # with its node locked: `suite.start`), each in id order: no two batches, nor a batch and
    # a start, wait on each other in a circle.
    done_nodes = sorted({node_id for node_id, report in reports if report.done})
    nodes = (
        {
            n.id: n
            for n in session.scalars(
                select(Node).where(Node.id.in_(done_nodes)).order_by(Node.id).with_for_update()
            )
        }
        if done_nodes
        else {}
    )
    wanted = sorted({i for i in ids if i is not None})
    found = (
        {
            b.id: b
            for b in session.scalars(
                select(BurnIn).where(BurnIn.id.in_(wanted)).order_by(BurnIn.id).with_for_update()
            )
        }
        if wanted
        else {}
    )
    judged: list[tuple[BurnIn, BurnInReport]] = []
    out: list[bool] = []
    for (node_id, report), bid in zip(reports, ids, strict=True):
        b = found.get(bid) if bid is not None else None
        if b is None or b.node_id != node_id or b.status != "running":
            out.append(False)  # withdrawn, finished, or another node's: stale
            continue
        results = [r.model_dump(mode="json") for r in report.results]
        if results == b.results and not report.done:
            out.append(False)
            continue
        b.results = results
        out.append(True)
        if report.done and b.node_id in nodes:
            judged.append((b, report))
    if not judged:
        return out
    racks = {
        rack_id: (region, rack)
        for rack_id, region, rack in session.execute(
            select(Rack.id, Region.name, Rack.name)
            .join(Region, Rack.region_id == Region.id)
            .where(Rack.id.in_({n.rack_id for n in nodes.values()}))
        )
    }
    for b, report in judged:
        node = nodes[b.node_id]
        _judge(session, b, report, Where(node, *racks[node.rack_id]), now)
    return out


def _judge(session: Session, b: BurnIn, report: BurnInReport, at: Where, now: datetime) -> None:
    """A finished burn-in's outcome, and its node moved (both locked by the caller)."""
    node = at.node
    optional = {s["name"] for s in b.suite if s.get("optional")}
    failed = next(
        (
            r
            for r in report.results
            if r.status != "passed" and not (r.status == "skipped" and r.name in optional)
        ),
        None,
    )
    if b.reason == "upgrade":
        # Its upgrade's controller moves the upgrade on from here (app/fleet/upgrades.py).
        enqueue(session, "fleet.upgrades", queue="fleet")
    if b.reason == "upgrade" and failed is not None and failed.name.startswith(suite.INSTALL):
        # Software that would not install: no repair mends that; the node stays out for
        # the operator (and the upgrade counts a failure).
        _software_failed(session, b, node, failed.name, failed.detail or failed.status, now)
    elif b.reason == "upgrade" and failed is None and node.drift:
        # Every step passed, yet the agent reports other versions than the stack pins.
        _software_failed(session, b, node, "verify", "still runs " + "; ".join(node.drift), now)
    elif failed is None and len(report.results) >= len(b.suite):
        _passed(session, b, at, now)
    else:
        why = (
            f"{failed.status.replace('_', ' ')}"
            + (f" on GPU {failed.gpu}" if failed.gpu is not None else "")
            + (f": {failed.detail}" if failed.detail else "")
            if failed is not None
            else "ended before every step ran"
        )
        _failed(
            session,
            b,
            node,
            failed.name if failed else "suite",
            failed.gpu if failed else None,
            why,
            now,
            at=at,
        )


def overdue(session: Session, now: datetime) -> int:
    """Burn-ins past their limit (the agent never finished: hung, or silent): failed."""
    n = 0
    for b in session.scalars(
        select(BurnIn).where(BurnIn.status == "running").order_by(BurnIn.id).with_for_update()
    ):
        if as_aware(b.started_at) + timedelta(seconds=suite.limit_s(b)) > now:
            continue
        node = session.scalar(select(Node).where(Node.id == b.node_id).with_for_update())
        if node is None:
            continue
        done = [r["name"] for r in b.results]
        step = next((s["name"] for s in b.suite if s["name"] not in done), "suite")
        _failed(session, b, node, step, None, "no result from the node's agent in time", now)
        n += 1
    return n


def _software_failed(
    session: Session, b: BurnIn, node: Node, step: str, why: str, now: datetime
) -> None:
    b.status, b.finished_at = "failed", now
    b.failed_step = step[:63]
    if step == "verify":
        b.results = [*b.results, {"name": "verify", "status": "failed", "detail": why[:500]}]
    lifecycle.nodes_changed(session, [node.name])


def _passed(session: Session, b: BurnIn, at: Where, now: datetime) -> None:
    node = at.node
    b.status, b.finished_at = "passed", now
    lifecycle.nodes_changed(session, [node.name])  # its agent may forget the burn-in
    node.production_at = node.production_at or now
    rep = session.get(HealthRepair, b.repair_id) if b.repair_id else None
    if rep is not None and rep.finished_at is None:
        gpus = list(
            session.scalars(
                select(Gpu)
                .where(Gpu.node_id == node.id, Gpu.health == H.validating.value)
                .with_for_update()
            )
        )
        current = [x for x in [node, *gpus] if x.health == H.validating.value]
        return_to_service(session, rep, at, current, now)
        return
    if node.health == H.validating.value:
        move(session, at, node, H.healthy, f"burn-in passed ({b.reason}): in service", now=now)
        kick_placement(session, at.region)


def _failed(
    session: Session,
    b: BurnIn,
    node: Node,
    step: str,
    gpu: int | None,
    why: str,
    now: datetime,
    at: Where | None = None,
) -> None:
    b.status, b.finished_at = "failed", now
    b.failed_step, b.failed_gpu = step[:63], gpu
    lifecycle.nodes_changed(session, [node.name])
    at = at or where(session, node)
    rep = session.get(HealthRepair, b.repair_id) if b.repair_id else None
    if rep is not None and rep.finished_at is None:
        rep.phase, rep.finished_at, rep.outcome = "done", now, "failed"
    cause = f"burn-in failed at {step}: {why}"[:480]
    if node.health != H.validating.value:
        return  # moved on meanwhile (an operator, a fault): the failure is recorded only
    # Failures in a row: since the node last passed, or last went out for RMA (a swapped
    # part starts afresh).
    since = session.scalar(
        select(func.max(BurnIn.finished_at)).where(
            BurnIn.node_id == node.id, BurnIn.status.in_(("passed", "rma"))
        )
    )
    failures = (
        session.scalar(
            select(func.count())
            .select_from(BurnIn)
            .where(
                BurnIn.node_id == node.id,
                BurnIn.status == "failed",
                *([BurnIn.finished_at > since] if since is not None else []),
            )
        )
        or 0
    )
    if failures >= 2:
        b.status = "rma"
        move(session, at, node, H.out_of_service, f"{cause}; failed twice: out for RMA", now=now)
        return
    move(session, at, node, H.quarantined, cause, now=now)
    gpus = [g for g in node.gpus if gpu is not None and g.index == gpu]
    for g in gpus:
        if g.health in (H.healthy.value, H.suspect.value):
            move(session, at, g, H.quarantined, cause, now=now)
    start_repair(
        session, at, None, [g for g in gpus if g.health == H.quarantined.value], "reboot", True, now
    )


def bring_up(session: Session, now: datetime) -> BringUp:
    """Nodes validating (bring-up, after a repair or an RMA return, in an upgrade) or with an
    agent and never in production: where each is, and why it is stuck if it is: a burn-in
    past its limit, an agent gone silent, work still on it (steps run only while it is idle),
    a failed burn-in or install waiting for the operator, an inventory that differs."""
    silent_after = timedelta(seconds=get_settings().heartbeat_timeout_seconds)
    rows = _bring_up_nodes(session)
    ids = [n.id for n, *_ in rows]
    latest: dict[uuid.UUID, BurnIn] = {}
    for b in session.scalars(
        select(BurnIn).where(BurnIn.node_id.in_(ids)).order_by(BurnIn.started_at)
    ):
        latest[b.node_id] = b  # the newest wins
    busy = set(
        session.scalars(
            select(Allocation.node_id).where(
                Allocation.node_id.in_(ids), Allocation.released_at.is_(None)
            )
        )
    )
    items = []
    for node, region, rack, agent, heard in rows:
        b = latest.get(node.id)
        running = b is not None and b.status == "running"
        done = len(b.results) if b is not None else 0
        step = b.suite[done]["name"] if running and done < len(b.suite) else None
        limit = as_aware(b.started_at) + timedelta(seconds=suite.limit_s(b)) if running else None
        stuck = _stuck(node, b, agent, heard, step, limit, node.id in busy, now, silent_after)
        items.append(
            BringUpNode(
                node=node.name,
                region=region,
                rack=rack,
                health=node.health,
                state=node.state,
                why=b.reason if running and b is not None else (node.health_reason or "-")[:120],
                since=node.health_since,
                step=step,
                steps_done=done,
                steps=len(b.suite) if b is not None else 0,
                limit_at=limit,
                stuck=stuck[:500] if stuck else None,
            )
        )
    return BringUp(items=items, stuck=sum(i.stuck is not None for i in items))


def _bring_up_nodes(session: Session) -> Sequence[Any]:
    """(node, region, rack, its agent's id, its last heartbeat) for the nodes `bring_up` shows."""
    return session.execute(
        select(Node, Region.name, Rack.name, AgentNode.node_id, NodeHeartbeat.last_seen_at)
        .join(Rack, Rack.id == Node.rack_id)
        .join(Region, Region.id == Rack.region_id)
        .outerjoin(AgentNode, AgentNode.node_id == Node.id)
        .outerjoin(NodeHeartbeat, NodeHeartbeat.node_id == Node.id)
        .where(
            or_(
                Node.health == H.validating.value,
                and_(AgentNode.node_id.is_not(None), Node.production_at.is_(None)),
                # A node with an agent out of service (silent, being repaired): not "in
                # service" here while the Health page and the heatmap say it is out.
                and_(
                    AgentNode.node_id.is_not(None),
                    Node.health.not_in([H.healthy.value, H.suspect.value]),
                ),
            ),
            Node.state != "retired",
        )
        .order_by(Region.name, Rack.name, Node.name)
    ).all()


def _stuck(
    node: Node,
    b: BurnIn | None,
    agent: uuid.UUID | None,
    heard: datetime | None,
    step: str | None,
    limit: datetime | None,
    busy: bool,
    now: datetime,
    silent_after: timedelta,
) -> str | None:
    """Why a node in bring-up is stuck, the first reason that holds; None if it is not."""
    running = b is not None and b.status == "running"
    if agent is None:
        return "no agent has reported for it"
    if running and limit is not None and now > limit:
        return f"burn-in past its limit at {step or 'its last step'}"
    if heard is not None and now - as_aware(heard) > silent_after:
        return f"its agent is silent since {as_aware(heard):%Y-%m-%d %H:%M:%S}"
    if running and busy:
        return "work still runs on it: burn-in steps run only while it is idle"
    if b is not None and b.status in ("failed", "rma"):
        detail = next((r.get("detail") for r in b.results if r["name"] == b.failed_step), "")
        return f"{b.reason} failed at {b.failed_step}" + (f": {detail}" if detail else "")
    if not running and node.state == "validating":
        return node.state_reason or "its inventory differs from the fleet's record"
    if not running and node.health == H.validating.value:
        return "validating with no burn-in running" + (
            f" ({node.health_reason})" if node.health_reason else ""
        )
    return None
