"""What the health loop keeps: heartbeats, per-GPU telemetry aggregates (not the series:
that is Prometheus's job), incidents, the history of health transitions, and repairs.

Heartbeats and aggregates live in tables of their own, not on `nodes`/`gpus`: those rows bump
the region's fleet version (placement re-reads the fleet), and a heartbeat is not a change."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, new_id


class Health(str, enum.Enum):
    healthy = "healthy"
    suspect = "suspect"
    quarantined = "quarantined"
    draining = "draining"
    repairing = "repairing"
    validating = "validating"
    out_of_service = "out_of_service"
    unreachable = "unreachable"  # nodes only


# The OpenAPI document names this schema by the module it was first written in (another
# `Health`, the probes' answer, shares its short name); generated clients know it by that name.
Health.__module__ = "app.health.states"

# What placement may use: healthy GPUs fully, suspect ones last and never for a new gang's
# fast class (placement core: DEGRADED); the rest not at all (FAILED).
PLACEABLE = frozenset({Health.healthy, Health.suspect})


class NodeHeartbeat(Base):
    """When the node last pushed telemetry (written at most every few seconds), and whether it
    has an agent: only a node with one is expected to keep reporting (its silence is a fault).

    A node has an agent on evidence of one, not on any report: its reports came as a stream
    (each within a heartbeat timeout of the one before) with at least `AGENT_BEATS` heartbeats
    over at least `AGENT_SPAN` of the timeout (`telemetry.ingest` decides as it writes them).
    One push, or a few within seconds, by an operator, a test or a chaos injection is not an
    agent, and its silence afterwards is no incident. Once shown, the agent is expected until an
    operator releases the node from `unreachable` (they vouch for it: it must stream again)."""

    __tablename__ = "node_heartbeats"

    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    last_seen_at: Mapped[datetime] = mapped_column(index=True)
    # The current stream of reports: when it began and the heartbeats written in it.
    stream_since: Mapped[datetime | None] = mapped_column(default=None)
    stream_beats: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    agent: Mapped[bool] = mapped_column(default=False, server_default=false())
    # Its reports do not reach the control plane (a chaos experiment's node loss: the network
    # between agent and API is cut, so they are dropped at the door, unread).
    partitioned: Mapped[bool] = mapped_column(default=False, server_default=false())


class GpuTelemetry(Base):
    """What the health logic needs of a GPU's telemetry: the counters' last values (deltas are
    taken against them), the last Xid and recovery action seen (a repeat of the same gauge is
    not a new fault), latest gauges, and rolling aggregates for the performance score."""

    __tablename__ = "gpu_telemetry"

    gpu_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("gpus.id", ondelete="CASCADE"), primary_key=True
    )
    updated_at: Mapped[datetime] = mapped_column()
    last_xid: Mapped[int] = mapped_column(Integer, default=0)
    last_recovery_action: Mapped[int] = mapped_column(Integer, default=0)
    counters: Mapped[dict] = mapped_column(JSON, default=dict)
    latest: Mapped[dict] = mapped_column(JSON, default=dict)
    # Exponentially weighted, over reports under load: SM clock / the model's nominal clock,
    # and the share of reports with throttling reasons set.
    clock_ratio: Mapped[float | None] = mapped_column(Float, default=None)
    throttled: Mapped[float | None] = mapped_column(Float, default=None)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)


class IncidentState:
    open = "open"  # signals may still join it (within the burst window)
    closed = "closed"


class HealthIncident(Base):
    """Fault signals on one node, grouped: a burst until the window passes without one. Its
    class is its worst row (`action`, `code`); its effect is applied as it escalates."""

    __tablename__ = "health_incidents"
    __table_args__ = (
        Index(
            "ix_health_incidents_open",
            "node_id",
            postgresql_where=text("state = 'open'"),
            sqlite_where=text("state = 'open'"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    region: Mapped[str] = mapped_column(String(63), index=True)
    state: Mapped[str] = mapped_column(String(8), default=IncidentState.open)
    opened_at: Mapped[datetime] = mapped_column(index=True)
    last_signal_at: Mapped[datetime] = mapped_column()
    closed_at: Mapped[datetime | None] = mapped_column(default=None)
    # The worst row so far: "xid" and its code, or a signal's name; its action and words.
    signal: Mapped[str] = mapped_column(String(32))
    code: Mapped[int | None] = mapped_column(Integer, default=None)
    action: Mapped[str] = mapped_column(String(24))
    what: Mapped[str] = mapped_column(String(300))
    # What has been carried out so far (scope and repair), so an escalation adds only the rest.
    scope: Mapped[str] = mapped_column(String(8), default="none")
    repair: Mapped[str] = mapped_column(String(8), default="none")
    gpu_indices: Mapped[list] = mapped_column(JSON, default=list)
    signals: Mapped[list] = mapped_column(JSON, default=list)  # the first few, for operators
    signal_count: Mapped[int] = mapped_column(Integer, default=0)
    # Set when the circuit breaker held back what the incident asked for.
    held_back: Mapped[str | None] = mapped_column(String(300), default=None)


class HealthEvent(Base):
    """One row per health transition of a GPU (gpu_index set) or a node: the history."""

    __tablename__ = "health_events"
    __table_args__ = (Index("ix_health_events_node_at", "node_id", "at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    gpu_index: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    region: Mapped[str] = mapped_column(String(63))
    rack: Mapped[str] = mapped_column(String(63))
    from_state: Mapped[str] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(8))
    cause: Mapped[str] = mapped_column(String(500))
    incident_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    # GPUs this transition took out of the pool automatically: what the circuit breaker sums.
    taken_out: Mapped[int] = mapped_column(SmallInteger, default=0)
    at: Mapped[datetime] = mapped_column(index=True)


class HealthRepair(Base):
    """A GPU reset or a node reboot asked of the provider: when it is due to be done, and how
    it went (`health.repair` completes it; the reconciler finds those a lost message missed)."""

    __tablename__ = "health_repairs"
    __table_args__ = (
        Index(
            "ix_health_repairs_pending",
            "due_at",
            postgresql_where=text("finished_at IS NULL"),
            sqlite_where=text("finished_at IS NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    gpu_index: Mapped[int | None] = mapped_column(SmallInteger, default=None)  # None: the node
    kind: Mapped[str] = mapped_column(String(8))  # reset | reboot | return (a silent node's)
    incident_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    # The GPUs it repairs (a reboot repairs the node and the GPUs that faulted).
    gpu_indices: Mapped[list] = mapped_column(JSON, default=list)
    phase: Mapped[str] = mapped_column(String(12), default="repairing")  # then validating
    started_at: Mapped[datetime] = mapped_column()
    due_at: Mapped[datetime] = mapped_column()  # when its current phase ends
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    outcome: Mapped[str | None] = mapped_column(String(16), default=None)  # ok | failed


class IdleIron(Base):
    """GPU-seconds that ready, healthy GPUs spent with nothing on them, per region and model:
    added up by the health sweep (what /metrics shows as idle iron)."""

    __tablename__ = "idle_iron"

    region: Mapped[str] = mapped_column(String(63), primary_key=True)
    gpu_model: Mapped[str] = mapped_column(String(32), primary_key=True)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    updated_at: Mapped[datetime] = mapped_column()


class IdleTime(Base):
    """GPU-seconds that GPUs spent with nothing on them, by hour, region, model and why: added
    up by the health sweep. Causes: `no_demand` (ready and healthy, nothing waits for it),
    `stranded` (ready and healthy while work that could use its model waits: quotas, topology,
    fragmentation), `unhealthy` (out of the pool by the health loop), `cordoned` (an operator's
    cordon, drain or down)."""

    __tablename__ = "idle_time"

    bucket: Mapped[datetime] = mapped_column(primary_key=True)  # the hour it began
    region: Mapped[str] = mapped_column(String(63), primary_key=True)
    gpu_model: Mapped[str] = mapped_column(String(32), primary_key=True)
    cause: Mapped[str] = mapped_column(String(16), primary_key=True)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    updated_at: Mapped[datetime] = mapped_column(index=True)


class BurnIn(Base):
    """A node's validation suite run by its agent before the node takes work: at bring-up,
    after a node-level repair or an RMA return, after an upgrade. The node stays `validating`
    until every step passes; a failure names the step and the GPU."""

    __tablename__ = "burn_ins"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), index=True
    )
    # The repair whose validation this is (none at bring-up).
    repair_id: Mapped[uuid.UUID | None] = mapped_column(default=None)
    reason: Mapped[str] = mapped_column(String(16))  # bring-up | repair | return | upgrade
    status: Mapped[str] = mapped_column(
        String(12), default="running"
    )  # passed | failed | withdrawn
    suite: Mapped[list] = mapped_column(JSON)  # the steps as the agent was given them
    results: Mapped[list] = mapped_column(JSON, default=list)
    failed_step: Mapped[str | None] = mapped_column(String(63), default=None)
    failed_gpu: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    gpus: Mapped[int] = mapped_column(SmallInteger)  # GPU-hours out of service: gpus x time
    started_at: Mapped[datetime] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
