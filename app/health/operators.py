"""Operators' hands: quarantine, release or retire a GPU (or a whole node) by hand."""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.health import states
from app.health.repairs import start_validation
from app.health.states import Actor, Health
from app.health.transitions import H, move, where
from app.models.fleet import Gpu, Node
from app.models.health import NodeHeartbeat
from app.workloads.disruptions import interrupt_on_fault
from app.workloads.queueing import kick_placement

OPERATOR_ACTIONS = ("quarantine", "release", "retire")


def operator_action(
    session: Session, node: Node, gpu: Gpu | None, action: str, reason: str | None
) -> str:
    """Quarantine, release or retire a GPU (or a whole node) by hand. Quarantine and retire
    stop the work on it now (requeued ahead of its peers: not its owner's doing); release
    returns it to service (through validation when it was out of service or unreachable).
    Returns the new state; a move the table forbids is a 409."""
    at = where(session, node)
    subject: Node | Gpu = gpu if gpu is not None else node
    is_node = gpu is None
    now = utcnow()
    why = f"{action}d by an operator" + (f": {reason}" if reason else "")
    current = Health(subject.health)
    if action == "release":
        if current is H.healthy:
            return current.value  # nothing to release: idempotent
        if current in (H.out_of_service, H.unreachable):
            if is_node and current is H.unreachable:
                # The operator vouches for the node: its agent is expected again once it shows
                # itself by a new stream (else its silence would take the node out again).
                session.execute(
                    update(NodeHeartbeat)
                    .where(NodeHeartbeat.node_id == node.id)
                    .values(agent=False, stream_since=None, stream_beats=0)
                )
            move(session, at, subject, H.validating, why, actor=Actor.operator, now=now)
            start_validation(
                session,
                node,
                [] if is_node else [gpu.index],  # type: ignore[union-attr]
                "return" if is_node else "reset",
                now,
            )
            return subject.health
        move(session, at, subject, H.healthy, why, actor=Actor.operator, now=now)

        kick_placement(session, at.region)
        return subject.health
    to = H.quarantined if action == "quarantine" else H.out_of_service
    if current is to:
        return current.value
    states.check(current, to, Actor.operator, node=is_node)
    interrupt_on_fault(
        session,
        node,
        None if is_node else [gpu.index],  # type: ignore[union-attr]
        "node" if is_node else "gpu",
        now,
        why,
        {"action": f"operator_{action}", "xid": None, "signal": "operator"},
    )
    move(session, at, subject, to, why, actor=Actor.operator, now=now)
    return subject.health


def act(session: Session, node: Node, gpu: Gpu | None, action: str, reason: str | None) -> dict:
    """An operator's quarantine, release or retire of a node or one of its GPUs, answered as
    REST and GraphQL show it."""
    health = operator_action(session, node, gpu, action, reason)
    return {"node_id": node.id, "gpu_index": gpu.index if gpu else None, "health": health}
