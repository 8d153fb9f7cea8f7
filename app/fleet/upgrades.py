"""Rolling upgrades: a region's or pool's nodes moved to one software stack a few at a time,
while the rest of the fleet keeps working (NVIDIA's GPU Operator upgrade controller, Slurm's
`scontrol reboot ASAP`, Kubernetes' drain under a PodDisruptionBudget, in one loop).

The nodes go in **units**: a node, or every node of one NVLink domain (an NVL72 rack's GPUs
are one fabric: it moves as one). `units_at_once` units are in flight together, and a unit
starts only while the scope's GPUs out of service (in flight, or out for any other reason:
a fault, an operator's cordon) stay within `max_unavailable_pct` of its GPUs; a unit may
always start when nothing else is out, so a unit larger than the budget still moves, alone.

Each node of a unit goes:
- **draining**: cordoned (nothing new lands). Running work that checkpoints is told to move
  at its next checkpoint (it resumes elsewhere from it, losing nothing but the time to
  restart, when capacity allows: `health.migrate`); at the drain deadline (the largest
  checkpoint interval of its work, capped at `drain_wait_s`; at once for a node whose work
  never checkpoints) the node drains: what still runs gets the preemption grace and moves.
- **applying**: when nothing is held on it, the node's stack becomes the target (it is then
  drifted until its agent reports the new versions) and its agent runs one job, while idle:
  the operator's install command for each component whose version differs or is unknown,
  then the burn-in suite; it reads its inventory again and reports. The node is back in
  service (its operator state restored) only when every step passed and no component drifts.
- **failed**: a step failed (an install: the node stays out, cordoned, for the operator; a
  hardware check: the health loop's repair and RMA path, as at bring-up), or the job was
  withdrawn. Failures past `max_failures` pause the upgrade: units in flight finish, none
  start, until it is resumed (failed nodes are tried again) or rolled back (every node it
  touched goes through the same phases back to the stack it ran before).

The install commands are the operator's (`RACKPLANE_UPGRADE_COMMANDS`), read when the
upgrade starts and kept with it, never taken from the request: an API key that may start an
upgrade must not be one that runs arbitrary commands as root on every host.

`advance` is level-triggered: the beat calls it (`fleet.upgrades`), and so does anything that
may move an upgrade on; it reads the state and takes the next steps, in one transaction with
the upgrade's row locked, so two workers never advance one upgrade at once.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware, get_or_404, utcnow
from app.core.errors import Conflict, NotFound, ValidationFailed
from app.fleet.schemas import UPGRADE_PHASES as PHASES
from app.fleet.schemas import (
    UpgradeCreate,
    UpgradeList,
    UpgradeNodeOut,
    UpgradeOut,
    UpgradeProgress,
    UpgradeReport,
)
from app.fleet.service import change_node_state, set_node_state
from app.health import suite
from app.health.states import PLACEABLE
from app.health.transitions import H, move, where
from app.models.agents import AgentNode
from app.models.fleet import (
    STACK_COMPONENTS,
    Gpu,
    Node,
    NodeState,
    Rack,
    Region,
    SoftwareStack,
    Upgrade,
    UpgradeNode,
    UpgradeState,
)
from app.models.health import BurnIn
from app.models.workloads import Allocation, State, Workload
from app.outbox.service import enqueue
from app.placement.model import cuda_code
from app.stacks import service as stacks
from app.workloads.disruptions import tell_owner
from app.workloads.queueing import kick_placement
from rackplane_wire import BurnInStep

# Install order: the image first (a reimage), firmware before the driver that loads it, the
# fabric manager matching the driver, then the user-space libraries.
ORDER = ("os_image", "firmware", "driver", "fabric_manager", "cuda", "nccl")
assert set(ORDER) == set(STACK_COMPONENTS)
IN_FLIGHT = ("draining", "applying")
ACTIVE = (UpgradeState.running.value, UpgradeState.paused.value, UpgradeState.rolling_back.value)
TAKES_PART = (NodeState.ready.value, NodeState.cordoned.value)
# A node's health that lets the upgrade take it: in service, or being validated (a failed
# install tried again, a bring-up's burn-in the upgrade's job replaces).
TAKEN_HEALTH = {*(h.value for h in PLACEABLE), H.validating.value}


# --- the operator's install commands -----------------------------------------------------------


class CommandsError(ValueError):
    """The operator's upgrade commands file cannot be used."""


class _Command(BaseModel):
    model_config = {"extra": "forbid"}
    command: list[str] = Field(min_length=1, max_length=128)
    timeout_s: float = Field(1800.0, gt=0, le=86_400)


class _CommandsFile(BaseModel):
    model_config = {"extra": "forbid"}
    os_image: _Command | None = None
    firmware: _Command | None = None
    driver: _Command | None = None
    fabric_manager: _Command | None = None
    cuda: _Command | None = None
    nccl: _Command | None = None


@lru_cache
def _file_commands(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
        parsed = _CommandsFile.model_validate(data)
    except OSError as exc:
        raise CommandsError(f"upgrade commands {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise CommandsError(f"upgrade commands {path} are not valid YAML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise CommandsError(f"upgrade commands {path}: {problems}") from None
    return parsed.model_dump(exclude_none=True)


def commands() -> dict[str, dict[str, Any]]:
    """component -> {command, timeout_s}: the operator's, or none configured."""
    path = get_settings().upgrade_commands
    return _file_commands(path) if path is not None else {}


def check_commands() -> None:
    """Raise CommandsError when the configured file cannot be used (the API's startup)."""
    commands()


# --- starting one -----------------------------------------------------------------------------


class UpgradeRefused(Conflict):
    code = "upgrade_refused"
    title = "The upgrade cannot start"


def _scope_nodes(session: Session, kind: str, name: str) -> list[Node]:
    stmt = (
        select(Node)
        .join(Rack, Rack.id == Node.rack_id)
        .join(Region, Region.id == Rack.region_id)
        .where(Node.state != NodeState.retired.value)
        .order_by(Rack.name, Node.name)
    )
    stmt = stmt.where(Region.name == name) if kind == "region" else stmt.where(Node.pool == name)
    return list(session.scalars(stmt))


def _differs(component: str, want: str, have: str | None) -> bool:
    if have is None:
        return True  # unknown: installed (the commands are idempotent), then verified
    if component == "cuda":
        return cuda_code(want) != cuda_code(have)
    return want != have


def units_at_once(batch: str, units: int) -> int:
    """`N` units, or `N%` of them (rounded down), at least one and at most all."""
    if batch.endswith("%"):
        n = math.floor(float(batch[:-1]) / 100 * units)  # as maxUnavailable: down, at least 1
    else:
        n = int(batch)
    return max(1, min(n, units))


def start(session: Session, body: UpgradeCreate, requested_by: str | None) -> Upgrade:
    """Begin an upgrade of the scope's nodes that do not run `body.stack` as it pins it."""
    stack = stacks.get(session, body.stack)
    kind, scope = ("region", body.region) if body.region is not None else ("pool", body.pool)
    assert scope is not None
    todo = _nodes_to_upgrade(session, stack, kind, scope)
    cmds = _commands_for(session, stack, todo)
    domains: dict[str, int] = {}  # a unit per NVLink domain, numbered as first met
    for n in todo:
        domains.setdefault(n.nvlink_domain, len(domains))
    up = Upgrade(
        id=uuid.uuid4(),
        stack_id=stack.id,
        scope_kind=kind,
        scope=scope,
        batch=body.batch,
        units_at_once=units_at_once(body.batch, len(domains)),
        max_unavailable_pct=body.max_unavailable_pct,
        max_failures=body.max_failures,
        drain_wait_s=body.drain_wait_s,
        state=UpgradeState.running.value,
        failures=0,
        failures_before=0,
        requested_by=requested_by,
        commands={c: cmds[c] for c in ORDER if c in cmds and c in stack.components},
    )
    session.add(up)
    session.flush()
    _add_nodes(session, up, todo, domains)
    session.flush()
    enqueue(session, "fleet.upgrades", queue="fleet", upgrade_id=str(up.id))
    return up


def _nodes_to_upgrade(session: Session, stack, kind: str, scope: str) -> list[Node]:
    """The scope's nodes not on the stack as it pins it; refused when there are none, or
    when any is in another upgrade."""
    nodes = _scope_nodes(session, kind, scope)
    if not nodes:
        raise NotFound(f"No nodes in {kind} {scope!r}.", code=f"{kind}_not_found")
    todo = [n for n in nodes if n.stack_id != stack.id or n.drift]
    if not todo:
        raise UpgradeRefused(
            f"Every node of {kind} {scope} runs stack {stack.name} already.",
            code="nothing_to_upgrade",
        )
    busy = session.scalars(
        select(Node.name)
        .join(UpgradeNode, UpgradeNode.node_id == Node.id)
        .join(Upgrade, Upgrade.id == UpgradeNode.upgrade_id)
        .where(Upgrade.state.in_(ACTIVE), Node.id.in_([n.id for n in todo]))
        .limit(10)
    ).all()
    if busy:
        raise UpgradeRefused(
            f"Nodes {', '.join(busy)} are in another upgrade: resume, finish or roll it back "
            "first.",
            code="upgrade_in_progress",
            nodes=list(busy),
        )
    return todo


def _commands_for(session: Session, stack, todo: list[Node]) -> dict:
    """The operator's install commands, refused when a node has no agent to run them or a
    component the nodes run at another version has none."""
    inventories = dict(
        session.execute(
            select(AgentNode.node_id, AgentNode.inventory).where(
                AgentNode.node_id.in_([n.id for n in todo])
            )
        ).all()
    )
    agentless = [n.name for n in todo if n.id not in inventories]
    if agentless:
        raise UpgradeRefused(
            f"{len(agentless)} node(s) have no agent to install the stack: "
            f"{', '.join(agentless[:10])}.",
            code="node_without_agent",
            nodes=agentless[:100],
        )
    cmds = commands()
    wanted = {
        c
        for n in todo
        for c, v in stack.components.items()
        if (inventories.get(n.id) or {}).get(stacks.REPORTED[c]) not in (None, v)
        and _differs(c, v, (inventories.get(n.id) or {}).get(stacks.REPORTED[c]))
    }
    missing = sorted(wanted - set(cmds))
    if missing:
        raise ValidationFailed(
            f"No command installs {', '.join(missing)}, which the nodes run at other versions "
            "than the stack pins: add them to the operator's RACKPLANE_UPGRADE_COMMANDS file.",
            code="no_upgrade_command",
            components=missing,
        )
    return cmds


def _add_nodes(session: Session, up: Upgrade, todo: list[Node], domains: dict[str, int]) -> None:
    """The upgrade's node rows, in the units `domains` numbers."""
    gpus = dict(
        session.execute(
            select(Gpu.node_id, func.count())
            .where(Gpu.node_id.in_([n.id for n in todo]))
            .group_by(Gpu.node_id)
        ).all()
    )
    for n in todo:
        part = n.state in TAKES_PART
        session.add(
            UpgradeNode(
                upgrade_id=up.id,
                node_id=n.id,
                unit=domains[n.nvlink_domain],
                gpus=gpus.get(n.id, 0),
                from_stack_id=n.stack_id,
                prior_state=n.state if part else NodeState.ready.value,
                phase="pending" if part else "skipped",
                detail=None if part else f"the node is {n.state}",
                work_moved=0,
                out_s=0.0,
            )
        )


# --- moving it on ------------------------------------------------------------------------------


def advance_all(session: Session, now: datetime | None = None) -> int:
    """Advance every active upgrade; how many there were."""
    ids = list(session.scalars(select(Upgrade.id).where(Upgrade.state.in_(ACTIVE))))
    for uid in ids:
        advance(session, uid, now or utcnow())
    return len(ids)


def advance(session: Session, upgrade_id: uuid.UUID, now: datetime) -> str:
    """One look at the upgrade: move each in-flight node on, pause past the failure
    threshold, start the next units the budget allows, finish. Returns its state."""
    up = session.scalar(select(Upgrade).where(Upgrade.id == upgrade_id).with_for_update())
    if up is None or up.state not in ACTIVE:
        return up.state if up else "missing"
    rows = list(
        session.execute(
            select(UpgradeNode, Node)
            .join(Node, Node.id == UpgradeNode.node_id)
            .where(UpgradeNode.upgrade_id == up.id)
            .order_by(UpgradeNode.unit, Node.name)
            .with_for_update(of=[UpgradeNode, Node])
        ).all()
    )
    for un, node in rows:
        if un.phase == "draining":
            _drain_step(session, up, un, node, now)
        elif un.phase == "applying":
            _apply_step(session, up, un, node, now)
    if (
        up.state == UpgradeState.running.value
        and up.failures - up.failures_before >= up.max_failures
    ):
        failed = [n.name for un, n in rows if un.phase == "failed"]
        up.state = UpgradeState.paused.value
        up.state_reason = (
            f"paused: {up.failures - up.failures_before} failure(s), the threshold is "
            f"{up.max_failures} ({', '.join(failed[:5])}); resume or roll back"
        )[:500]
    if up.state in (UpgradeState.running.value, UpgradeState.rolling_back.value):
        _start_units(session, up, rows, now)
    if not any(un.phase in (*IN_FLIGHT, "pending") for un, _ in rows):
        if up.state == UpgradeState.rolling_back.value:
            up.state, up.state_reason = UpgradeState.rolled_back.value, None
            up.finished_at = now
        elif up.state == UpgradeState.running.value or not any(
            un.phase == "failed" for un, _ in rows
        ):
            failed = sum(un.phase == "failed" for un, _ in rows)
            up.state = UpgradeState.done.value
            up.state_reason = f"{failed} node(s) failed" if failed else None
            up.finished_at = now
    session.flush()
    return up.state


def _target(session: Session, up: Upgrade, un: UpgradeNode) -> SoftwareStack | None:
    sid = un.from_stack_id if up.state == UpgradeState.rolling_back.value else up.stack_id
    return session.get(SoftwareStack, sid) if sid is not None else None


def _words(session: Session, up: Upgrade, un: UpgradeNode) -> str:
    target = _target(session, up, un)
    if up.state == UpgradeState.rolling_back.value:
        return f"rollback to stack {target.name if target else '(none)'}"
    return f"upgrade to stack {target.name if target else '(none)'}"


def _start_units(
    session: Session, up: Upgrade, rows: list[tuple[UpgradeNode, Node]], now: datetime
) -> None:
    """Take the next pending units while fewer than `units_at_once` are in flight and the
    scope's GPUs out of service stay within the budget."""
    in_flight = {un.unit for un, _ in rows if un.phase in IN_FLIGHT}
    pending: dict[int, list[tuple[UpgradeNode, Node]]] = {}
    for un, node in rows:
        if un.phase == "pending":
            pending.setdefault(un.unit, []).append((un, node))
    if not pending or len(in_flight) >= up.units_at_once:
        return
    scope = _scope_gpus(session, up)
    total = sum(g for g, _ in scope.values())
    out = sum(g for g, available in scope.values() if not available)
    budget = math.floor(up.max_unavailable_pct / 100 * total)
    units = []
    for unit, members in sorted(pending.items()):
        if any(n.health not in TAKEN_HEALTH for _, n in members):
            continue  # out for a fault (in repair, quarantined): taken when it is back
        sizes = [scope.get(n.id, (0, False)) for _, n in members]
        units.append((unit, members, sum(g for g, available in sizes if available)))
    # Units already out of service (a failed node tried again, one cordoned by an operator)
    # cost nothing of the budget: first; then the rest in order, while the budget allows.
    units.sort(key=lambda u: (u[2] > 0, u[0]))
    for unit, members, adds in units:
        if len(in_flight) >= up.units_at_once:
            return
        if adds and out + adds > budget and (in_flight or out > 0):
            return  # over the budget: wait for units to come back (order is kept)
        for un, node in members:
            _take(session, up, un, node, now)
        in_flight.add(unit)
        out += adds


def _scope_gpus(session: Session, up: Upgrade) -> dict[uuid.UUID, tuple[int, bool]]:
    """node -> (GPUs, in service now) for every node of the upgrade's scope."""
    placeable = [h.value for h in PLACEABLE]
    stmt = (
        select(Node.id, Node.state, Node.health, func.count())
        .select_from(Node)
        .join(Node.gpus)
        .join(Rack, Rack.id == Node.rack_id)
        .join(Region, Region.id == Rack.region_id)
        .where(Node.state != NodeState.retired.value)
        .group_by(Node.id, Node.state, Node.health)
    )
    stmt = (
        stmt.where(Region.name == up.scope)
        if up.scope_kind == "region"
        else stmt.where(Node.pool == up.scope)
    )
    return {
        nid: (int(n), state == NodeState.ready.value and health in placeable)
        for nid, state, health, n in session.execute(stmt)
    }


def _take(session: Session, up: Upgrade, un: UpgradeNode, node: Node, now: datetime) -> None:
    """Cordon the node; work that checkpoints moves at its next checkpoint; the drain
    deadline is when the rest moves."""
    words = _words(session, up, un)
    if node.state == NodeState.ready.value:
        change_node_state(session, node, NodeState.cordoned.value, words)
    elif node.state == NodeState.cordoned.value:
        node.state_reason = words
    held = list(
        session.scalars(
            select(Workload)
            .where(
                Workload.id.in_(
                    select(Allocation.workload_id).where(
                        Allocation.node_id == node.id, Allocation.released_at.is_(None)
                    )
                )
            )
            .order_by(Workload.id)
            .with_for_update()
        )
    )
    wait = 0.0
    for w in held:
        if w.state == State.running.value and w.checkpoint_interval_s:
            tell_owner(
                session,
                w,
                f"node {node.name} is leaving service for an {words}",
                {"reason": "node_upgrade", "node": node.name, "upgrade": str(up.id)},
                move_to="another node",
            )
            wait = max(wait, min(float(w.checkpoint_interval_s), float(up.drain_wait_s)))
    un.phase, un.taken_at, un.back_at = "draining", now, None
    un.drain_deadline = now + timedelta(seconds=wait)
    un.work_moved = (un.work_moved or 0) + len(held)
    un.detail = None
    if not held:
        _apply(session, up, un, node, now)
    elif not wait:  # nothing on it checkpoints: no reason to wait, drain now
        change_node_state(session, node, NodeState.draining.value, f"{words}: draining")


def _drain_step(session: Session, up: Upgrade, un: UpgradeNode, node: Node, now: datetime) -> None:
    live = session.scalar(
        select(func.count())
        .select_from(Allocation)
        .where(Allocation.node_id == node.id, Allocation.released_at.is_(None))
    )
    if not live:
        _apply(session, up, un, node, now)
    elif (
        un.drain_deadline is not None
        and now >= as_aware(un.drain_deadline)
        and node.state != NodeState.draining.value
    ):
        # What did not move at a checkpoint gets the preemption grace, then moves.
        change_node_state(
            session, node, NodeState.draining.value, f"{_words(session, up, un)}: draining"
        )


def _install_steps(up: Upgrade, target: SoftwareStack | None, inv: dict | None) -> list:
    if target is None:
        return []
    steps = []
    for c in ORDER:
        want = target.components.get(c)
        cmd = (up.commands or {}).get(c)
        if not want or cmd is None:
            continue
        if not _differs(c, want, (inv or {}).get(stacks.REPORTED[c])):
            continue
        argv = [
            a.replace("{version}", want).replace("{component}", c).replace("{stack}", target.name)
            for a in cmd["command"]
        ]
        steps.append(
            BurnInStep(
                name=f"{suite.INSTALL}{c.replace('_', '-')}",
                command=argv,
                timeout_s=cmd["timeout_s"],
            )
        )
    return steps


def _apply(session: Session, up: Upgrade, un: UpgradeNode, node: Node, now: datetime) -> None:
    """Nothing is held on the node: it takes the target stack; its agent installs what
    differs and burns it in."""
    target = _target(session, up, un)
    words = _words(session, up, un)
    if node.state == NodeState.draining.value:
        set_node_state(node, NodeState.cordoned.value, words)
    inv = session.scalar(select(AgentNode.inventory).where(AgentNode.node_id == node.id))
    node.stack_id = target.id if target is not None else None
    stacks.refresh(session, node, inv, target)
    install = _install_steps(up, target, inv)
    checks = suite.suite_for(node, un.gpus) if get_settings().burn_in else []
    un.phase = "applying"
    if not install and not checks:
        _back(session, up, un, node, now)
        return
    at = where(session, node)
    if node.health == H.suspect.value:
        move(session, at, node, H.healthy, f"{words}: judged afresh by its burn-in", now=now)
    if node.health == H.healthy.value:
        move(session, at, node, H.validating, f"{words}: install, then burn-in", now=now)
    b = suite.start(session, node, "upgrade", un.gpus, now, steps=[*install, *checks])
    un.burn_in_id = b.id


def _apply_step(session: Session, up: Upgrade, un: UpgradeNode, node: Node, now: datetime) -> None:
    b = session.get(BurnIn, un.burn_in_id) if un.burn_in_id else None
    if b is None or b.status == "running":
        return
    if b.status == "passed":
        _back(session, up, un, node, now)
        return
    if b.status == "withdrawn":
        why = "its job was withdrawn (a repair or another burn-in took the node)"
    else:
        detail = next((r.get("detail") for r in b.results if r["name"] == b.failed_step), None)
        why = f"failed at {b.failed_step}" + (f": {detail}" if detail else "")
        if b.status == "rma":
            why += "; failed burn-in twice: out for RMA"
    un.phase, un.detail = "failed", why[:500]
    up.failures += 1
    if node.state in (NodeState.cordoned.value, NodeState.draining.value):
        node.state_reason = f"{_words(session, up, un)} {why}"[:500]


def _back(session: Session, up: Upgrade, un: UpgradeNode, node: Node, now: datetime) -> None:
    """The node passed: back in the state it was in before the upgrade took it."""
    rolling = up.state == UpgradeState.rolling_back.value
    un.phase = "rolled_back" if rolling else "done"
    un.back_at, un.detail = now, None
    _restore(node, un)
    kick_placement(session, where(session, node).region)


def _restore(node: Node, un: UpgradeNode) -> None:
    if node.state not in (NodeState.cordoned.value, NodeState.draining.value):
        return  # an operator moved it meanwhile: theirs
    if un.prior_state == NodeState.ready.value:
        set_node_state(node, NodeState.ready.value, None)
    else:
        set_node_state(node, NodeState.cordoned.value, "cordoned before the upgrade")


# --- the operator's controls -------------------------------------------------------------------


def get(session: Session, upgrade_id: str | uuid.UUID, lock: bool = False) -> Upgrade:
    return get_or_404(session, Upgrade, upgrade_id, what="upgrade", for_update=lock)


class UpgradeStateConflict(Conflict):
    code = "invalid_upgrade_transition"
    title = "The upgrade cannot do that now"


def resume(session: Session, up: Upgrade) -> Upgrade:
    """A paused upgrade goes on; its failed nodes are tried again."""
    if up.state != UpgradeState.paused.value:
        raise UpgradeStateConflict(
            f"A {up.state} upgrade cannot be resumed; only a paused one.", state=up.state
        )
    now = utcnow()
    for un in session.scalars(
        select(UpgradeNode).where(UpgradeNode.upgrade_id == up.id, UpgradeNode.phase == "failed")
    ):
        _again(un, now)
    up.state, up.state_reason = UpgradeState.running.value, None
    up.failures_before = up.failures
    session.flush()
    enqueue(session, "fleet.upgrades", queue="fleet", upgrade_id=str(up.id))
    return up


def rollback(session: Session, up: Upgrade) -> Upgrade:
    """Every node the upgrade touched goes back to the stack it ran before, through the same
    phases; nodes it had not reached are left alone."""
    if up.state not in (
        UpgradeState.running.value,
        UpgradeState.paused.value,
        UpgradeState.done.value,
    ):
        raise UpgradeStateConflict(f"A {up.state} upgrade cannot be rolled back.", state=up.state)
    now = utcnow()
    rows = list(
        session.execute(
            select(UpgradeNode, Node)
            .join(Node, Node.id == UpgradeNode.node_id)
            .where(UpgradeNode.upgrade_id == up.id)
            .with_for_update(of=[UpgradeNode, Node])
        ).all()
    )
    for un, node in rows:
        if un.phase == "pending":
            un.phase, un.detail = "skipped", "rolled back before it was reached"
        elif un.phase == "draining" and node.stack_id == un.from_stack_id:
            # Nothing installed yet: it only goes back into service.
            _again(un, now)
            un.phase = "rolled_back"
            un.back_at = now
            _restore(node, un)
        elif un.phase in ("draining", "applying", "done", "failed"):
            if un.from_stack_id is None:
                un.phase = "failed"
                un.detail = "it ran no declared stack before: nothing to roll back to"
                continue
            if un.burn_in_id is not None:
                b = session.get(BurnIn, un.burn_in_id)
                if b is not None and b.status == "running":
                    b.status, b.finished_at = "withdrawn", now
            _again(un, now)
    up.state, up.state_reason = UpgradeState.rolling_back.value, None
    up.finished_at = None
    session.flush()
    kick_placement(session, None)
    enqueue(session, "fleet.upgrades", queue="fleet", upgrade_id=str(up.id))
    return up


def _again(un: UpgradeNode, now: datetime) -> None:
    """The node goes through the phases again: its time out so far is kept."""
    if un.taken_at is not None:
        un.out_s = (un.out_s or 0.0) + max(
            0.0,
            ((as_aware(un.back_at) if un.back_at else now) - as_aware(un.taken_at)).total_seconds(),
        )
    un.taken_at = un.back_at = un.drain_deadline = None
    un.burn_in_id = None
    un.phase, un.detail = "pending", None


# --- what it reports ---------------------------------------------------------------------------


def describe(session: Session, up: Upgrade, nodes: bool = True) -> UpgradeOut:
    now = utcnow()
    end = as_aware(up.finished_at) if up.finished_at else now
    rows = session.execute(
        select(UpgradeNode, Node.name)
        .join(Node, Node.id == UpgradeNode.node_id)
        .where(UpgradeNode.upgrade_id == up.id)
        .order_by(UpgradeNode.unit, Node.name)
    ).all()
    names = dict(session.execute(select(SoftwareStack.id, SoftwareStack.name)).all())
    counts: dict[str, int] = {}
    gpu_s = 0.0
    for un, _ in rows:
        counts[un.phase] = counts.get(un.phase, 0) + 1
        out = un.out_s or 0.0
        if un.taken_at is not None:
            stop = as_aware(un.back_at) if un.back_at else end
            out += max(0.0, (stop - as_aware(un.taken_at)).total_seconds())
        gpu_s += out * un.gpus
    return UpgradeOut(
        id=up.id,
        stack=names.get(up.stack_id, "?"),
        scope_kind=up.scope_kind,
        scope=up.scope,
        batch=up.batch,
        units_at_once=up.units_at_once,
        max_unavailable_pct=up.max_unavailable_pct,
        max_failures=up.max_failures,
        drain_wait_s=up.drain_wait_s,
        state=up.state,
        state_reason=up.state_reason,
        requested_by=up.requested_by,
        created_at=up.created_at,
        finished_at=up.finished_at,
        progress=UpgradeProgress(**{p: counts.get(p, 0) for p in PHASES}),
        report=UpgradeReport(
            nodes=len(rows),
            gpu_hours_out_of_service=round(gpu_s / 3600, 3),
            work_moved=sum(un.work_moved or 0 for un, _ in rows),
            failures=up.failures,
        ),
        nodes=[
            UpgradeNodeOut(
                node=name,
                unit=un.unit,
                phase=un.phase,
                detail=un.detail,
                from_stack=names.get(un.from_stack_id) if un.from_stack_id else None,
                work_moved=un.work_moved or 0,
                taken_at=un.taken_at,
                back_at=un.back_at,
            )
            for un, name in rows
        ]
        if nodes
        else [],
    )


def list_all(session: Session, limit: int = 100) -> UpgradeList:
    ups = list(session.scalars(select(Upgrade).order_by(Upgrade.created_at.desc()).limit(limit)))
    return UpgradeList(items=[describe(session, u, nodes=False) for u in ups])
