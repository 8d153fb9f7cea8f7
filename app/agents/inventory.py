"""What a node's agent says the host has, against what the fleet records: GPUs by index, their
model, MIG mode and UUID. A difference is never silent: the node goes to `validating` with the
difference named, and comes back to `ready` by itself once an inventory matches again."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.agents import mig
from app.core import pubsub
from app.core.config import get_settings
from app.core.db import utcnow
from app.health import suite, telemetry
from app.health.transitions import move, where
from app.models.agents import AgentNode
from app.models.fleet import Gpu, Node, NodeState
from app.models.health import Health
from app.scheduling.lifecycle import agent_topic
from app.stacks import service as stacks
from app.tenancy.nodes import NodeCaller
from rackplane_wire import GpuInfo, Inventory, InventoryVerdict

# Why a node is validating, as its state_reason begins: the agent lifts only what it set.
REASON = "inventory differs from the fleet's record: "


def differences(
    gpus: list[Gpu], reported: list[GpuInfo], elsewhere: dict[str, tuple[str, int]] | None = None
) -> list[str]:
    """Each way the host's GPUs differ from the fleet's record of the node, in words.
    `elsewhere`: reported UUIDs the fleet records on other nodes' GPUs (UUID -> node, index)."""
    elsewhere = elsewhere or {}
    have = {g.index: g for g in reported}
    out = []
    for g in sorted(gpus, key=lambda g: g.index):
        r = have.pop(g.index, None)
        if r is None:
            out.append(f"GPU {g.index} missing (the fleet records a {g.model})")
            continue
        if r.model != g.model:
            out.append(f"GPU {g.index} is a {r.model}, the fleet records a {g.model}")
        if r.mig_mode != g.mig_mode:
            on = "on" if r.mig_mode else "off"
            out.append(f"GPU {g.index} has MIG mode {on}, the fleet records it {_onoff(g)}")
        if r.uuid in elsewhere:
            node, index = elsewhere[r.uuid]
            out.append(
                f"GPU {g.index} reports {r.uuid}, which the fleet records on node {node} "
                f"GPU {index}"
            )
        elif g.uuid is not None and r.uuid != g.uuid:
            out.append(f"GPU {g.index} is {r.uuid}, the fleet records {g.uuid} (replaced?)")
    for index, r in sorted(have.items()):
        out.append(f"GPU {index} ({r.model}) is not in the fleet's record")
    uuids = [r.uuid for r in reported]
    for u in sorted({u for u in uuids if uuids.count(u) > 1}):
        out.append(f"UUID {u} is reported for more than one GPU")
    return out


def _onoff(g: Gpu) -> str:
    return "on" if g.mig_mode else "off"


def report(session: Session, caller: NodeCaller, inv: Inventory) -> InventoryVerdict:
    """Take the agent's inventory: compare, record the GPUs' UUIDs where they match, keep the
    inventory (assignments name devices by it), and move the node in or out of `validating`."""
    node = session.scalar(select(Node).where(Node.id == caller.node_id).with_for_update())
    assert node is not None  # the credential's node (a node's credentials go with it)
    gpus = list(session.scalars(select(Gpu).where(Gpu.node_id == node.id)))
    diff = differences(gpus, inv.gpus, _held_elsewhere(session, node, inv.gpus))
    if not diff:
        _learn_uuids(gpus, inv.gpus)
        mig.learn(gpus, inv.gpus)
    now = utcnow()
    row = session.get(AgentNode, node.id)
    document = inv.model_dump(mode="json")
    if row is None:
        row = AgentNode(node_id=node.id, node_name=node.name, desired_index=1)
        session.add(row)
    elif row.inventory != document or row.address != inv.address:
        # Assignments name devices (and a gang's MASTER_ADDR) by the inventory: a new one is a
        # new desired state, and cached answers of the old one go.
        row.desired_index += 1
        pubsub.mark(session, agent_topic(node.name))
    row.address = inv.address
    row.agent_version = inv.agent_version
    row.runtimes = list(inv.runtimes)
    said = {"run-uids", "ssh", "sev-snp", "tdx"} & set(inv.capabilities)
    offers = sorted(set(inv.runtimes) | said)
    if node.agent_offers != offers:
        node.agent_offers = offers  # the region's fleet version moves with the node row
    row.inventory = document
    row.differences = diff
    row.inventory_at = now
    if diff and node.state in (NodeState.ready.value, NodeState.validating.value):
        node.state = NodeState.validating.value
        node.state_reason = (REASON + "; ".join(diff))[:500]
    elif (
        not diff
        and node.state == NodeState.validating.value
        and (node.state_reason or "").startswith(REASON)
    ):
        node.state = NodeState.ready.value
        node.state_reason = None
    stacks.refresh(session, node, document)
    session.flush()
    telemetry.agent_joined(session, node.id)
    if not diff:
        bring_up(session, node, len(gpus), now)
    return InventoryVerdict(
        node=node.name, matches=not diff, differences=diff, node_state=node.state
    )


def bring_up(session: Session, node: Node, gpus: int, now) -> None:
    """A node that has never passed a burn-in is burned in before it takes work: its first
    matching inventory starts one (again after a failed one was repaired and it reports)."""
    if node.production_at is not None or not get_settings().burn_in:
        return
    if node.health != Health.healthy.value or suite.active(session, node.id) is not None:
        return
    at = where(session, node)
    move(session, at, node, Health.validating, "bring-up: burn-in before it takes work", now=now)
    suite.start(session, node, "bring-up", gpus, now)


def _held_elsewhere(
    session: Session, node: Node, reported: list[GpuInfo]
) -> dict[str, tuple[str, int]]:
    """The reported UUIDs the fleet records on other nodes' GPUs: UUID -> (node, GPU index).
    An inventory never takes such a UUID from its GPU (telemetry would then land on the wrong
    one): a host claiming it is a difference, named with the node that holds it. Two hosts
    claiming one new UUID at once: the unique index refuses the second (409)."""
    uuids = sorted({r.uuid for r in reported})
    if not uuids:
        return {}
    rows = session.execute(
        select(Gpu.uuid, Node.name, Gpu.index)
        .join(Node, Node.id == Gpu.node_id)
        .where(Gpu.uuid.in_(uuids), Gpu.node_id != node.id)
    )
    return {u: (name, index) for u, name, index in rows}


def _learn_uuids(gpus: list[Gpu], reported: list[GpuInfo]) -> None:
    """Record the UUIDs the fleet does not know yet (telemetry then names GPUs by them). Only
    on an inventory without differences: none of them is recorded on another node's GPU."""
    by_index = {r.index: r.uuid for r in reported}
    for g in gpus:
        if g.uuid is None and g.index in by_index:
            g.uuid = by_index[g.index]
