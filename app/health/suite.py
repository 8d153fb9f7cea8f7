"""Burn-in's suite, and starting a burn-in: what a node's agent runs before the node takes work.

The suite is the operator's (`RACKPLANE_BURN_IN_SUITE`: a YAML file of steps, checked when the
API starts) or, by default, two checks of tools a GPU host may have: `dcgmi diag -r 3` (DCGM's
medium diagnostic: deployment, PCIe, memory, targeted stress) and nccl-tests' `all_reduce_perf`
over large messages across the node's GPUs, held to 80 % of the model's published bus
bandwidth (`GpuModel.nccl_busbw_gbps`). Both are optional: where the host has no DCGM or no
nccl-tests, the step is skipped (and says so), not failed. A burn-in starts at bring-up (a
node's first matching inventory), after a node-level repair or an RMA return; `burnin.take`
judges the agent's report.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.models.agents import AgentNode
from app.models.fleet import Node
from app.models.health import BurnIn
from app.placement.catalog import GPU_MODELS
from app.scheduling import lifecycle
from rackplane_wire import BurnIn as WireBurnIn
from rackplane_wire import BurnInStep

INSTALL = "install-"  # an upgrade's install step is named install-<component>
BOUND_SHARE = 0.8  # of the model's published bus bandwidth
# Time the agent gets beyond the steps' own limits (it runs a step only while idle, reports
# every heartbeat) before an unfinished burn-in counts as failed.
SLACK_S = 600.0


class SuiteError(ValueError):
    """The operator's suite file cannot be used."""


class _SuiteFile(BaseModel):
    steps: list[BurnInStep] = Field(min_length=1, max_length=32)


@lru_cache
def _file_suite(path: Path) -> tuple[BurnInStep, ...]:
    try:
        data = yaml.safe_load(path.read_text())
        return tuple(_SuiteFile.model_validate(data).steps)
    except OSError as exc:
        raise SuiteError(f"burn-in suite {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise SuiteError(f"burn-in suite {path} is not valid YAML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise SuiteError(f"burn-in suite {path}: {problems}") from None


def check_suite() -> None:
    """Raise SuiteError when the configured suite file cannot be used (the API's startup)."""
    path = get_settings().burn_in_suite
    if path is not None:
        _file_suite(path)


def suite_for(node: Node, gpus: int) -> list[BurnInStep]:
    path = get_settings().burn_in_suite
    if path is not None:
        return list(_file_suite(path))
    expected = GPU_MODELS[node.gpu_model].nccl_busbw_gbps if node.gpu_model in GPU_MODELS else None
    steps = [
        BurnInStep(
            name="dcgm-diag",
            command=["dcgmi", "diag", "-r", "3"],
            timeout_s=2700,
            optional=True,
        )
    ]
    if gpus >= 2:
        steps.append(
            BurnInStep(
                name="nccl-all-reduce",
                command=["all_reduce_perf", "-b", "1G", "-e", "8G", "-f", "2", "-g", "{gpus}"],
                timeout_s=900,
                min_busbw_gbps=round(expected * BOUND_SHARE, 1) if expected else None,
                optional=True,
            )
        )
    return steps


def wanted(session: Session, node: Node) -> bool:
    """Whether the node is validated by burn-in: burn-in is on and an agent runs the node."""
    return get_settings().burn_in and (
        session.scalar(select(AgentNode.node_id).where(AgentNode.node_id == node.id)) is not None
    )


def active(session: Session, node_id: uuid.UUID) -> BurnIn | None:
    return session.scalar(
        select(BurnIn).where(BurnIn.node_id == node_id, BurnIn.status == "running")
    )


def for_repair(session: Session, repair_id: uuid.UUID) -> BurnIn | None:
    return session.scalar(
        select(BurnIn).where(BurnIn.repair_id == repair_id).order_by(BurnIn.started_at.desc())
    )


def start(
    session: Session,
    node: Node,
    reason: str,
    gpus: int,
    now: datetime,
    repair_id: uuid.UUID | None = None,
    steps: list[BurnInStep] | None = None,
) -> BurnIn:
    """A new burn-in for the node (any running one is withdrawn); its agent is told at once.
    `steps`: other steps than the suite (an upgrade's installs, then the suite)."""
    session.execute(
        update(BurnIn)
        .where(BurnIn.node_id == node.id, BurnIn.status == "running")
        .values(status="withdrawn", finished_at=now)
    )
    steps = steps if steps is not None else suite_for(node, gpus)
    row = BurnIn(
        id=uuid.uuid4(),
        node_id=node.id,
        repair_id=repair_id,
        reason=reason,
        status="running",
        suite=[s.model_dump(mode="json") for s in steps],
        results=[],
        gpus=gpus,
        started_at=now,
    )
    session.add(row)
    lifecycle.nodes_changed(session, [node.name])
    return row


def limit_s(b: BurnIn) -> float:
    """How long the burn-in may take before it counts as failed."""
    return sum(float(s["timeout_s"]) for s in b.suite) + SLACK_S


def wire(b: BurnIn) -> WireBurnIn:
    # An upgrade's steps change the host's software: its agent reads its inventory again.
    return WireBurnIn(
        id=str(b.id), steps=[BurnInStep(**s) for s in b.suite], reinventory=b.reason == "upgrade"
    )
