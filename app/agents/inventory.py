"""What a node's agent says the host has, against what the fleet records: GPUs by index, their
model, MIG mode and UUID. A difference is never silent: the node goes to `validating` with the
difference named, and comes back to `ready` by itself once an inventory matches again."""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.agents import mig
from app.audit import service as audit
from app.core import pubsub
from app.core.config import get_settings
from app.core.db import utcnow
from app.health import suite, telemetry
from app.health.transitions import move, where
from app.models.agents import AgentNode
from app.models.fleet import AWAITING_AGENT, Gpu, Node, NodeState, Rack
from app.models.health import Health
from app.models.workloads import Allocation, GpuUsage
from app.placement.catalog import GPU_MODELS, RACK_KINDS
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
    elsewhere = _held_elsewhere(session, node, inv.gpus)
    diff = differences(gpus, inv.gpus, elsewhere)
    if diff and node.adopt_inventory:
        refused = adopt(session, node, gpus, inv, elsewhere)
        if refused is None:
            gpus = list(session.scalars(select(Gpu).where(Gpu.node_id == node.id)))
            diff = differences(gpus, inv.gpus, elsewhere)
        else:
            diff = [*diff, f"not adopted: {refused}"]
    # Only the first inventory after the join is adopted: a GPU lost later is a difference
    # (and its node validating), never a new record.
    node.adopt_inventory = False
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
    said = {"run-uids", "ssh", "sev-snp", "tdx", "volumes", "shared-volumes"} & set(
        inv.capabilities
    )
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


def adopt(
    session: Session,
    node: Node,
    gpus: list[Gpu],
    inv: Inventory,
    elsewhere: dict[str, tuple[str, int]],
) -> str | None:
    """The node's agent joined with an adopting token (`rackplane fleet join-token NODE
    --adopt`): its inventory becomes the node's GPUs' record (model, count, MIG mode, UUIDs),
    once, where the rack's kind sells that model and count and nothing runs on the node.
    Why it cannot be, or None when it was."""
    models = sorted({g.model for g in inv.gpus})
    rack_kind = session.scalar(select(Rack.kind).where(Rack.id == node.rack_id))
    spec = RACK_KINDS.get(rack_kind or "")
    if not inv.gpus:
        return "the agent reports no GPU"
    if len(models) > 1:
        return f"its GPUs are of several models ({', '.join(models)}): one model per node"
    model = models[0]
    if model not in GPU_MODELS:
        return f"{model} is not a GPU model the fleet knows ({', '.join(GPU_MODELS)})"
    if spec is None or model not in spec.gpu_models:
        return f"{model} is not sold in {rack_kind} racks"
    counts = {spec.gpus_per_node, *spec.other_gpu_counts}
    if len(inv.gpus) not in counts:
        return f"{rack_kind} nodes have {' or '.join(map(str, sorted(counts)))} GPUs"
    if sorted(g.index for g in inv.gpus) != list(range(len(inv.gpus))):
        return "its GPU indices are not 0 to n-1"
    if elsewhere:
        return "a GPU it reports is recorded on another node"
    busy = session.scalar(
        select(Allocation.id)
        .where(Allocation.node_id == node.id, Allocation.released_at.is_(None))
        .limit(1)
    )
    if busy is not None:
        return "work holds GPUs on the node"
    by_index = {g.index: g for g in gpus}
    for r in inv.gpus:
        g = by_index.pop(r.index, None)
        if g is None:
            g = Gpu(node_id=node.id, index=r.index, health=Health.healthy.value)
            session.add(g)
        g.model, g.mig_mode, g.uuid = model, r.mig_mode, r.uuid
    for g in by_index.values():  # GPUs the host does not have
        session.delete(g)
    # The usage rows carry each GPU's memory (what fractional shares are checked against):
    # the adopted model's, and none for GPUs that are gone. Nothing is held (checked above).
    session.execute(
        delete(GpuUsage).where(
            GpuUsage.node_id == node.id, GpuUsage.gpu_index.not_in([r.index for r in inv.gpus])
        )
    )
    session.execute(
        update(GpuUsage)
        .where(GpuUsage.node_id == node.id)
        .values(memory_mib=GPU_MODELS[model].memory_mib)
    )
    was = f"{len(gpus)} x {node.gpu_model}"
    node.gpu_model = model
    node.adopt_inventory = False
    node.generation += 1
    session.flush()
    audit.record_system(
        session,
        "node.adopt",
        [
            (
                None,
                "node",
                node.id,
                {"gpus": len(inv.gpus), "gpu_model": model},
                {"was": was, "hostname": inv.hostname},
            )
        ],
    )
    return None


def bring_up(session: Session, node: Node, gpus: int, now) -> None:
    """A node that has never passed a burn-in is burned in before it takes work: its first
    matching inventory starts one (again after a failed one was repaired and it reports). A
    node imported for an agent waited for it, validating: its burn-in starts now (without
    burn-in, it is in service now)."""
    awaiting = node.health == Health.validating.value and node.health_reason == AWAITING_AGENT
    at = where(session, node)
    if awaiting and not get_settings().burn_in:
        move(session, at, node, Health.healthy, "its agent joined: in service", now=now)
        node.production_at = node.production_at or now
        return
    if node.production_at is not None or not get_settings().burn_in:
        return
    if suite.active(session, node.id) is not None:
        return
    if awaiting:
        node.health_reason = "bring-up: burn-in before it takes work"
    elif node.health == Health.healthy.value:
        move(
            session, at, node, Health.validating, "bring-up: burn-in before it takes work", now=now
        )
    else:
        return
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
