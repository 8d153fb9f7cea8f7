from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship
from sqlalchemy.sql.expression import false as sql_false

from app.core.db import Base, TimestampMixin, new_id
from app.models.health import Health

# Why a node imported for an agent (fleet file `agent: true`) is validating: no work until
# its agent joins and passes its bring-up burn-in (app/agents/inventory.py `bring_up`).
AWAITING_AGENT = "awaiting its agent: no work until it joins and passes its bring-up burn-in"


class NodeState(str, enum.Enum):
    ready = "ready"
    cordoned = "cordoned"
    draining = "draining"
    down = "down"
    retired = "retired"  # out of the fleet for good: work that needed it fails, not waits
    # Its agent's inventory differs from the fleet's record (a GPU missing, another model):
    # no new work until an inventory matches again or an operator decides.
    validating = "validating"


class Region(TimestampMixin, Base):
    __tablename__ = "regions"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    # Bumped (by PostgreSQL triggers, see migration 0011) in the transaction of any change to
    # the region's racks, nodes or GPUs: placement keeps a region's fleet while it holds.
    fleet_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    racks: Mapped[list[Rack]] = relationship(back_populates="region")


class Rack(TimestampMixin, Base):
    __tablename__ = "racks"
    __table_args__ = (UniqueConstraint("region_id", "name"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    region_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("regions.id", ondelete="RESTRICT"), index=True
    )
    name: Mapped[str] = mapped_column(String(63))
    kind: Mapped[str] = mapped_column(String(16))
    # A group of racks under one spine switch (Slurm's "block"); racks default to their own.
    block: Mapped[str] = mapped_column(String(63))
    region: Mapped[Region] = relationship(back_populates="racks")
    nodes: Mapped[list[Node]] = relationship(back_populates="rack")


# The components a software stack pins, in the order they are shown.
STACK_COMPONENTS = ("driver", "cuda", "nccl", "firmware", "fabric_manager", "os_image")


class SoftwareStack(TimestampMixin, Base):
    """A node software stack: driver, CUDA, NCCL, firmware/VBIOS, fabric manager and OS image,
    pinned together as one versioned artifact (a one-version skew inside a synchronous job
    hangs it). Immutable: a new version is a new stack."""

    __tablename__ = "software_stacks"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    description: Mapped[str | None] = mapped_column(String(500), default=None)
    # component -> version, for the components in STACK_COMPONENTS the stack pins.
    components: Mapped[dict] = mapped_column(JSON)


class Node(TimestampMixin, Base):
    __tablename__ = "nodes"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    rack_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("racks.id", ondelete="RESTRICT"), index=True
    )
    name: Mapped[str] = mapped_column(String(63), unique=True)
    gpu_model: Mapped[str] = mapped_column(String(32))
    cpu_milli: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=NodeState.ready.value, index=True)
    state_reason: Mapped[str | None] = mapped_column(String(500), default=None)
    # NVLink domain id: the rack for NVL72 (one domain of 72 GPUs), the node itself for HGX.
    nvlink_domain: Mapped[str] = mapped_column(String(140), index=True)
    # The health loop's verdict on the node as a whole (app/health/states.py); `state` is the
    # operator's. Placement uses a node when both allow it.
    health: Mapped[str] = mapped_column(String(16), default=Health.healthy.value)
    health_reason: Mapped[str | None] = mapped_column(String(500), default=None)
    health_since: Mapped[datetime | None] = mapped_column(default=None)
    # Bumped on every change that affects placement (optimistic concurrency for apply).
    generation: Mapped[int] = mapped_column(Integer, default=0)
    # The operator's grouping for stacks and upgrades (none: the node is its own).
    pool: Mapped[str | None] = mapped_column(String(63), default=None, index=True)
    # The software stack the node should run, and how what its agent reports differs from it
    # (each differing component in words; empty: none, or no agent reports). A drifted node
    # takes no gang until it matches. Its CUDA version as CUDA encodes it (12040: 12.4), from
    # its agent, else from its stack; 0: unknown.
    stack_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("software_stacks.id", ondelete="RESTRICT"), default=None, index=True
    )
    drift: Mapped[list] = mapped_column(JSON, default=list, server_default="[]")
    cuda_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # What its node agent can run (its runtimes, and `run-uids` when each run has a uid of its
    # own), as its last inventory said; None: no agent (the simulated provider runs anything).
    # Placement puts work only where its runtime is offered (and `process` only in the pools
    # the operator trusts with it: RACKPLANE_PROCESS_POOLS).
    agent_offers: Mapped[list | None] = mapped_column(JSON, default=None)
    # When its first burn-in passed (bring-up done; none for nodes without an agent).
    production_at: Mapped[datetime | None] = mapped_column(default=None)
    # Its agent joined with an adopting token: its next inventory becomes its GPUs' record
    # (app/agents/inventory.py `adopt`), once.
    adopt_inventory: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=sql_false()
    )
    rack: Mapped[Rack] = relationship(back_populates="nodes")
    gpus: Mapped[list[Gpu]] = relationship(back_populates="node", order_by="Gpu.index")


class Gpu(TimestampMixin, Base):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    index: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(32))
    mig_mode: Mapped[bool] = mapped_column(Boolean, default=False)
    # The health loop's state of this GPU (app/health/states.py), why, and since when.
    health: Mapped[str] = mapped_column(String(16), default=Health.healthy.value)
    health_reason: Mapped[str | None] = mapped_column(String(500), default=None)
    health_since: Mapped[datetime | None] = mapped_column(default=None)
    # As DCGM names it ("GPU-<uuid>"): telemetry may name a GPU by it instead of its index.
    uuid: Mapped[str | None] = mapped_column(String(64), default=None, index=True, unique=True)
    # Relative speed measured under load (1.0: the model's nominal), and when the evidence was
    # last seen: placement decays it toward nominal from then (app/placement/perf.py).
    perf: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    perf_at: Mapped[datetime | None] = mapped_column(default=None)
    # A MIG GPU's instances as its node's agent reports them: [[profile key, start], ...]
    # (placement puts MIG work only on these); None where nothing lays instances out (the
    # simulated provider: placement picks starts freely). A GPU being laid out again takes no
    # work until its agent reports (`relayout_pending`; app/fleet/mig.py).
    mig_layout: Mapped[list | None] = mapped_column(JSON, default=None)
    relayout_pending: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=sql_false()
    )
    node: Mapped[Node] = relationship(back_populates="gpus")


class ImportStatus(str, enum.Enum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"


class FleetImport(TimestampMixin, Base):
    """A validated fleet document waiting to be applied by the `fleet.import` task."""

    __tablename__ = "fleet_imports"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    status: Mapped[str] = mapped_column(String(16), default=ImportStatus.pending.value)
    source: Mapped[str | None] = mapped_column(String(300), default=None)
    document: Mapped[dict] = mapped_column(JSON)
    summary: Mapped[dict | None] = mapped_column(JSON, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class UpgradeState(str, enum.Enum):
    running = "running"
    paused = "paused"  # failures past its threshold: units in flight finish, none start
    done = "done"
    rolling_back = "rolling_back"
    rolled_back = "rolled_back"


class Upgrade(TimestampMixin, Base):
    """A rolling upgrade of a region's or pool's nodes to one software stack: a few units (a
    node, or an NVLink domain's nodes together) at a time, each drained, given the stack by its
    agent, burned in and returned to service (app/fleet/upgrades.py)."""

    __tablename__ = "upgrades"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    stack_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("software_stacks.id", ondelete="RESTRICT"), index=True
    )
    scope_kind: Mapped[str] = mapped_column(String(8))  # region | pool
    scope: Mapped[str] = mapped_column(String(63))
    batch: Mapped[str] = mapped_column(String(8))  # as asked: "2" or "10%"
    units_at_once: Mapped[int] = mapped_column(Integer)
    max_unavailable_pct: Mapped[float] = mapped_column(Float)
    max_failures: Mapped[int] = mapped_column(Integer)
    drain_wait_s: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=UpgradeState.running.value, index=True)
    state_reason: Mapped[str | None] = mapped_column(String(500), default=None)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    # Failures counted against max_failures start here (a resume starts afresh).
    failures_before: Mapped[int] = mapped_column(Integer, default=0)
    requested_by: Mapped[str | None] = mapped_column(String(120), default=None)
    # The operator's install commands as they were when it started: component -> {command,
    # timeout_s}.
    commands: Mapped[dict] = mapped_column(JSON, default=dict)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class UpgradeNode(Base):
    """One node of an upgrade, and where it is: pending -> draining -> applying -> done, or
    failed; skipped when it could not take part; on a rollback, the nodes it touched go
    through the same phases again towards the stack each ran before."""

    __tablename__ = "upgrade_nodes"
    __table_args__ = (UniqueConstraint("upgrade_id", "node_id"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    upgrade_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("upgrades.id", ondelete="CASCADE"), index=True
    )
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    unit: Mapped[int] = mapped_column(Integer)  # nodes of one unit move together, in order
    gpus: Mapped[int] = mapped_column(Integer)
    from_stack_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    prior_state: Mapped[str] = mapped_column(String(16))  # ready | cordoned: restored after
    phase: Mapped[str] = mapped_column(String(12), default="pending")
    detail: Mapped[str | None] = mapped_column(String(500), default=None)
    burn_in_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    drain_deadline: Mapped[datetime | None] = mapped_column(default=None)
    work_moved: Mapped[int] = mapped_column(Integer, default=0)
    # Out of service from taken_at to back_at (GPU-hours out: gpus x that, summed).
    taken_at: Mapped[datetime | None] = mapped_column(default=None)
    back_at: Mapped[datetime | None] = mapped_column(default=None)
    out_s: Mapped[float] = mapped_column(Float, default=0.0)  # earlier passes (a rollback's)


class MigRelayout(Base):
    """A MIG layout asked of one GPU (by an operator, or by demand), carried out by the node's
    agent only while the GPU is idle: pending until the agent reports it applied, refused
    (busy, or the model's geometry forbids it) or failed."""

    __tablename__ = "mig_relayouts"
    __table_args__ = (
        Index(
            "uq_mig_relayouts_pending",
            "node_id",
            "gpu_index",
            unique=True,
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    gpu_index: Mapped[int] = mapped_column(Integer)
    mig_mode: Mapped[bool] = mapped_column(Boolean)
    layout: Mapped[list] = mapped_column(JSON)  # [[profile key, start], ...]; [] when whole
    reason: Mapped[str] = mapped_column(String(16))  # operator | demand
    status: Mapped[str] = mapped_column(String(12), default="pending")
    detail: Mapped[str | None] = mapped_column(String(500), default=None)
    requested_at: Mapped[datetime] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
