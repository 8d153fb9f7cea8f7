"""Software stacks: operators declare them (immutable: a new version is a new stack) and which
nodes should run each; a node's agent reports what it runs, and a node whose versions differ
from its stack is drifted, with each differing component named. The placement core keeps
gangs off drifted nodes and never spans one gang across two stacks (app/placement/engine.py).

A component the agent does not report (NVML knows no NCCL; a host without a fabric manager) is
not compared: drift is what is known to differ, never a guess."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import Conflict, NotFound
from app.models.agents import AgentNode
from app.models.fleet import STACK_COMPONENTS, Node, Rack, Region, SoftwareStack
from app.placement.model import cuda_code
from app.stacks.schemas import StackAssign, StackAssigned, StackCreate, StackOut

# Where each component's version is in an agent's inventory (rackplane_wire.Inventory).
REPORTED = {
    "driver": "driver_version",
    "cuda": "cuda_version",
    "nccl": "nccl_version",
    "firmware": "firmware_version",
    "fabric_manager": "fabric_manager_version",
    "os_image": "os_image",
}
LABELS = {"fabric_manager": "fabric manager", "os_image": "OS image"}


def drift(stack: SoftwareStack | None, inventory: dict[str, Any] | None) -> list[str]:
    """Each component the agent reports at another version than the stack pins, in words."""
    if stack is None or not inventory:
        return []
    out = []
    for component in STACK_COMPONENTS:
        want = stack.components.get(component)
        have = inventory.get(REPORTED[component])
        if not want or not have:
            continue
        same = cuda_code(want) == cuda_code(have) if component == "cuda" else want == have
        if not same:
            label = LABELS.get(component, component)
            out.append(f"{label} {have} (stack {stack.name} pins {want})")
    return out


def refresh(
    session: Session,
    node: Node,
    inventory: dict[str, Any] | None,
    stack: SoftwareStack | None = None,
) -> None:
    """Bring the node's drift and CUDA version in line with its stack and its agent's latest
    inventory (None: no agent). Writes only what changed: a node row's update moves its
    region's fleet version, which makes placement read the fleet again."""
    if stack is None and node.stack_id is not None:
        stack = session.get(SoftwareStack, node.stack_id)
    found = drift(stack, inventory)
    cuda = cuda_code((inventory or {}).get("cuda_version")) or (
        cuda_code(stack.components.get("cuda")) if stack else 0
    )
    if list(node.drift or []) != found:
        node.drift = found
    if node.cuda_version != cuda:
        node.cuda_version = cuda


def create(session: Session, body: StackCreate) -> StackOut:
    if session.scalar(select(SoftwareStack.id).where(SoftwareStack.name == body.name)):
        raise Conflict(
            f"A stack named {body.name!r} exists; stacks never change: give a new version "
            "a new name.",
            code="stack_exists",
        )
    row = SoftwareStack(
        name=body.name,
        description=body.description,
        components=body.components.model_dump(exclude_none=True),
    )
    session.add(row)
    session.flush()
    return _out(row, 0, 0)


def get(session: Session, name: str) -> SoftwareStack:
    row = session.scalar(select(SoftwareStack).where(SoftwareStack.name == name))
    if row is None:
        raise NotFound(f"No software stack named {name!r}.", code="stack_not_found")
    return row


def describe(session: Session, row: SoftwareStack) -> StackOut:
    counts = _counts(session, [row.id])
    return _out(row, *counts.get(row.id, (0, 0)))


def list_all(session: Session) -> list[StackOut]:
    rows = list(session.scalars(select(SoftwareStack).order_by(SoftwareStack.name)))
    counts = _counts(session, [r.id for r in rows])
    return [_out(r, *counts.get(r.id, (0, 0))) for r in rows]


def _counts(session: Session, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[int, int]]:
    out: dict[uuid.UUID, tuple[int, int]] = {}
    if not ids:
        return out
    for sid, d in session.execute(select(Node.stack_id, Node.drift).where(Node.stack_id.in_(ids))):
        n, drifted = out.get(sid, (0, 0))
        out[sid] = (n + 1, drifted + bool(d))
    return out


def _out(row: SoftwareStack, nodes: int, drifted: int) -> StackOut:
    return StackOut(
        id=row.id,
        name=row.name,
        description=row.description,
        components=dict(row.components),
        created_at=row.created_at,
        nodes=nodes,
        drifted=drifted,
    )


def assign(session: Session, stack: SoftwareStack, target: StackAssign) -> StackAssigned:
    """Declare that the target's nodes should run `stack` (at once: a rolling upgrade is how
    to move busy nodes). Each node's drift is computed from its agent's latest inventory."""
    stmt = select(Node).order_by(Node.id).with_for_update(of=Node)
    if target.pool is not None:
        stmt = stmt.where(Node.pool == target.pool)
    elif target.region is not None:
        stmt = stmt.join(Rack, Rack.id == Node.rack_id).join(Region, Region.id == Rack.region_id)
        stmt = stmt.where(Region.name == target.region)
    else:
        stmt = stmt.where(Node.name.in_(sorted(set(target.nodes or []))))
    nodes = list(session.scalars(stmt))
    if target.nodes is not None:
        missing = sorted(set(target.nodes) - {n.name for n in nodes})
        if missing:
            raise NotFound(
                f"No node named {', '.join(missing[:10])}.", code="node_not_found", nodes=missing
            )
    elif not nodes:
        what, name = ("pool", target.pool) if target.pool is not None else ("region", target.region)
        raise NotFound(f"No nodes in {what} {name!r}.", code=f"{what}_not_found")
    inventories = dict(
        session.execute(
            select(AgentNode.node_id, AgentNode.inventory).where(
                AgentNode.node_id.in_([n.id for n in nodes])
            )
        ).all()
    )
    for node in nodes:
        if node.stack_id != stack.id:
            node.stack_id = stack.id
        refresh(session, node, inventories.get(node.id), stack)
    session.flush()
    return StackAssigned(
        stack=stack.name, nodes=len(nodes), drifted=sum(bool(n.drift) for n in nodes)
    )
