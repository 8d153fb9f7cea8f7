"""State changes of GPUs and nodes: every transition goes through `move`, which checks the
state table (`states.py`) and writes the history (`HealthEvent`) that the circuit breaker,
the repairs and the operators' views read."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core import pubsub
from app.core.db import utcnow
from app.health import states
from app.health.states import Actor, Health
from app.models.fleet import Gpu, Node, Rack, Region
from app.models.health import HealthEvent, HealthIncident

FLEET_TOPIC = "health-events"  # the feed topic (app/core/pubsub.py) of health events
H = Health


@dataclass
class Where:
    node: Node
    region: str
    rack: str


def where(session: Session, node: Node) -> Where:
    region, rack = session.execute(
        select(Region.name, Rack.name)
        .join(Rack, Rack.region_id == Region.id)
        .where(Rack.id == node.rack_id)
    ).one()
    return Where(node, region, rack)


def move(
    session: Session,
    at: Where,
    subject: Node | Gpu,
    to: Health,
    cause: str,
    *,
    actor: Actor = Actor.system,
    incident: HealthIncident | None = None,
    details: dict[str, Any] | None = None,
    taken_out: int = 0,
    now: datetime | None = None,
) -> None:
    """Move a GPU or node to `to` (or raise InvalidHealthTransition) and record the event."""
    is_node = isinstance(subject, Node)
    states.check(subject.health, to, actor, node=is_node)
    now = now or utcnow()
    before = subject.health
    subject.health = to.value
    subject.health_reason = cause[:500]
    subject.health_since = now
    session.add(
        HealthEvent(
            node_id=at.node.id,
            gpu_index=None if is_node else subject.index,  # type: ignore[union-attr]
            region=at.region,
            rack=at.rack,
            from_state=before,
            to_state=to.value,
            actor=actor.value,
            cause=cause[:500],
            incident_id=incident.id if incident is not None else None,
            details=details or {},
            taken_out=taken_out,
            at=now,
        )
    )
    pubsub.mark(session, FLEET_TOPIC)  # operators' live fleet view reads again after the commit
