"""Workloads, their event timeline, and tenant quotas."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from app.core.db import Base, TimestampMixin, new_id


@dataclass(frozen=True)
class WorkloadShape:
    """What one replica asks for, as the REST body gave it (`WorkloadCreate.shape`), as the
    workload row stores it and as the scheduling edge hands it to the core: exactly one of
    whole `gpus`, a MIG profile (its generic key, `3g`) or a share (`milli` with
    `gpu_memory_mib`), plus host CPU and memory, on any of `gpu_models` (empty: any model)."""

    gpus: int = 0
    mig_profile: str | None = None
    milli: int = 0
    gpu_memory_mib: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_models: tuple[str, ...] = ()

    @property
    def unit(self) -> str:
        """`whole`, `mig` or `fraction`: what kind of GPU capacity one replica takes."""
        return "whole" if self.gpus else "mig" if self.mig_profile else "fraction"

    def as_json(self) -> dict[str, Any]:
        return {
            "gpu_models": list(self.gpu_models),
            "gpus": self.gpus,
            "mig_profile": self.mig_profile,
            "milli": self.milli,
            "gpu_memory_mib": self.gpu_memory_mib,
            "cpu_milli": self.cpu_milli,
            "memory_mib": self.memory_mib,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> WorkloadShape:
        return cls(
            gpus=int(value.get("gpus") or 0),
            mig_profile=value.get("mig_profile") or None,
            milli=int(value.get("milli") or 0),
            gpu_memory_mib=int(value.get("gpu_memory_mib") or 0),
            cpu_milli=int(value.get("cpu_milli") or 0),
            memory_mib=int(value.get("memory_mib") or 0),
            gpu_models=tuple(value.get("gpu_models") or ()),
        )


class ShapeColumn(TypeDecorator[WorkloadShape]):
    """A `WorkloadShape` stored as the JSON object it has always been stored as."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: WorkloadShape | None, dialect: Dialect) -> Any:
        return None if value is None else value.as_json()

    def process_result_value(self, value: Any, dialect: Dialect) -> WorkloadShape | None:
        return None if value is None else WorkloadShape.from_json(value)


class State(str, enum.Enum):
    pending = "pending"
    queued = "queued"
    placing = "placing"
    provisioning = "provisioning"
    running = "running"
    checkpointing = "checkpointing"
    preempted = "preempted"
    succeeded = "succeeded"
    failed = "failed"
    terminated = "terminated"


class Workload(TimestampMixin, Base):
    __tablename__ = "workloads"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        CheckConstraint("replicas >= 1", name="replicas_positive"),
        CheckConstraint("max_runtime_s > 0", name="max_runtime_positive"),
        Index("ix_workloads_region_changed_xid", "region", "changed_xid"),
        # A region's queue, oldest first: what every placement cycle asks for, at a cost that
        # follows the queue, not the region.
        # Running work past its deadline: what the reconciler asks every few seconds.
        Index(
            "ix_workloads_run_deadline",
            "run_deadline_at",
            postgresql_where=text("state = 'running'"),
            sqlite_where=text("state = 'running'"),
        ),
        Index(
            "ix_workloads_queue",
            "region",
            "created_at",
            postgresql_where=text("state = 'queued'"),
            sqlite_where=text("state = 'queued'"),
        ),
        # Queued work held back (its dependencies, its array's limit): what the holds sweep
        # asks for every few seconds, at a cost that follows the held, not the queue.
        Index(
            "ix_workloads_held",
            "hold",
            postgresql_where=text("hold IS NOT NULL"),
            sqlite_where=text("hold IS NOT NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), index=True
    )
    name: Mapped[str | None] = mapped_column(String(200), default=None)
    kind: Mapped[str] = mapped_column(String(16))  # instance | vm | job
    # What it waits for before a cycle may place it (app/workloads/holds.py): the workloads and
    # arrays it depends on, as given (their elements are rows of `workload_dependencies`), and
    # while queued, why it is held back: `Dependency` (they have not all succeeded) or
    # `ArrayLimit` (its array has `max_parallel` elements under way). NULL: placeable.
    depends_on: Mapped[list | None] = mapped_column(JSON, default=None)
    hold: Mapped[str | None] = mapped_column(String(16), default=None)
    # One element of a job array: the array's id (shared by its elements), its index
    # (`RACKPLANE_ARRAY_INDEX`), how many elements it has and how many may be under way.
    array_id: Mapped[uuid.UUID | None] = mapped_column(default=None, index=True)
    array_index: Mapped[int | None] = mapped_column(Integer, default=None)
    array_count: Mapped[int | None] = mapped_column(Integer, default=None)
    array_max_parallel: Mapped[int | None] = mapped_column(Integer, default=None)
    state: Mapped[str] = mapped_column(String(16), default=State.pending.value, index=True)
    # The tier chosen at submission (placement core label): what may share hardware with it,
    # and what metering bills.
    tier: Mapped[str] = mapped_column(String(24))
    priority: Mapped[str] = mapped_column(String(24))
    shape: Mapped[WorkloadShape] = mapped_column(ShapeColumn)
    replicas: Mapped[int] = mapped_column(Integer, default=1)
    # An elastic gang (issue 46 §3): it may run on as few as `min_replicas` (None: not
    # elastic). `current_replicas` is the size it is placed or queued at now while it runs
    # short of `replicas` after losing a host (None: its full size); it grows back at a
    # checkpoint once capacity returns.
    min_replicas: Mapped[int | None] = mapped_column(Integer, default=None)
    current_replicas: Mapped[int | None] = mapped_column(Integer, default=None)
    gpu_milli: Mapped[int] = mapped_column(Integer)  # GPU-equivalents of all replicas
    topology: Mapped[dict | None] = mapped_column(JSON, default=None)
    region: Mapped[str | None] = mapped_column(String(63), default=None)
    # The software it needs: nodes running this stack (by name), or at least this CUDA version
    # (12040: 12.4; 0: any).
    stack: Mapped[str | None] = mapped_column(String(63), default=None)
    min_cuda: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_runtime_s: Mapped[int] = mapped_column(Integer)
    checkpoint_interval_s: Mapped[int | None] = mapped_column(Integer, default=None)
    checkpoint_cost_s: Mapped[int] = mapped_column(Integer, default=0)
    labels: Mapped[dict] = mapped_column(JSON, default=dict)
    image: Mapped[str | None] = mapped_column(String(500), default=None)
    # Where its command starts (WorkloadCreate.workdir: relative for processes, absolute in a
    # container).
    workdir: Mapped[str | None] = mapped_column(String(255), default=None)
    # What a node agent runs (app/agents): the argv, with `env`; `podman` runs it in `image`.
    command: Mapped[list | None] = mapped_column(JSON, default=None)
    env: Mapped[dict] = mapped_column(JSON, default=dict, server_default="{}")
    # Environment variables whose values are the tenant's secrets, by name ({VAR: secret}):
    # read when a run starts (app/agents/runs.py `run_env`), never stored here.
    secret_env: Mapped[dict] = mapped_column(JSON, default=dict, server_default="{}")
    runtime: Mapped[str] = mapped_column(String(16), default="process", server_default="process")
    # The tenant's volumes its runs mount ([{id, name, storage, mount_path, read_only}], as
    # resolved when it was submitted: app/workloads/volumes.py).
    volumes: Mapped[list | None] = mapped_column(JSON, default=None)
    # A gang's rendezvous port (`MASTER_PORT`) for its current attempt: chosen when it is
    # placed, from RACKPLANE_MASTER_PORTS, among those no other live gang whose replica 0 is on
    # the same node holds (app/scheduling/apply.py `give_master_ports`).
    master_port: Mapped[int | None] = mapped_column(Integer, default=None)

    @property
    def size(self) -> int:
        """How many replicas it is placed or queued at now (its `WORLD_SIZE`)."""
        return self.current_replicas or self.replicas

    # An instance one logs into: the tenant's SSH public keys it was launched with (OpenSSH
    # lines, as they were then: deleting a key later does not reach into a running instance),
    # and where its current run's SSH server is: the node's address, the port its agent picked,
    # and when a server first answered there (`ready`). Cleared when it is placed again.
    ssh_keys: Mapped[list | None] = mapped_column(JSON, default=None)
    ssh_host: Mapped[str | None] = mapped_column(String(253), default=None)
    ssh_port: Mapped[int | None] = mapped_column(Integer, default=None)
    ssh_ready_at: Mapped[datetime | None] = mapped_column(default=None)
    # A replica of an inference endpoint (app/endpoints): the endpoint, and where its current
    # run serves (the node's address, the port its agent published) and since when it answers
    # its readiness path. Cleared when it is placed again.
    endpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("endpoints.id", ondelete="SET NULL"), default=None, index=True
    )
    serve_host: Mapped[str | None] = mapped_column(String(253), default=None)
    serve_port: Mapped[int | None] = mapped_column(Integer, default=None)
    serve_ready_at: Mapped[datetime | None] = mapped_column(default=None)
    # The signal that asks the process for a checkpoint now (it keeps running).
    checkpoint_signal: Mapped[str] = mapped_column(
        String(12), default="SIGUSR1", server_default="SIGUSR1"
    )
    # Goes up each time someone asks for a checkpoint: agents send the signal once per step.
    checkpoint_requests: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Where its latest checkpoint is, and the step it holds: the next run resumes from it.
    last_checkpoint_uri: Mapped[str | None] = mapped_column(String(2000), default=None)
    last_checkpoint_step: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # How many times it has been placed: (id, attempt, replica) names one run on a node.
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    placement: Mapped[list | None] = mapped_column(JSON, default=None)
    last_checkpoint_at: Mapped[datetime | None] = mapped_column(default=None)
    last_checkpoint_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    preempted_at: Mapped[datetime | None] = mapped_column(default=None)
    # Set when it is evicted (its allocations released for the preemptor): until it stops or
    # `stop_deadline` passes, no one else starts on the GPUs it held (workloads.provision).
    evicted_at: Mapped[datetime | None] = mapped_column(default=None)
    stop_deadline: Mapped[datetime | None] = mapped_column(default=None)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    # Hardware faults that stopped it (app/health), and the work they cost: GPUs x seconds
    # since its last checkpoint (or its start), summed over its interruptions.
    interruptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lost_work_gpu_s: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # Requeued after a fault that was not its own: placed ahead of its priority peers
    # (Slurm's "expedited requeue") until it holds GPUs again.
    expedited: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # On a suspect GPU: moves at its next checkpoint when healthy capacity exists.
    migrate_at_checkpoint: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=false()
    )
    # What restarts it, and how often (app/workloads/restarts.py; None: the default policy);
    # the restarts it has had, by cause ({"failure": 2, ...}); and, after a restart that backs
    # off, the moment before which no cycle places it.
    restart_policy: Mapped[dict | None] = mapped_column(JSON, default=None)
    restart_counts: Mapped[dict] = mapped_column(JSON, default=dict, server_default="{}")
    not_before: Mapped[datetime | None] = mapped_column(default=None)
    # Shared GPUs ([node, index]) it must not be placed on again: a noisy neighbour's.
    avoid_gpus: Mapped[list | None] = mapped_column(JSON, default=None)
    # Its best reported step time on a shared GPU: the pace a neighbour's load is judged by.
    step_time_best_s: Mapped[float | None] = mapped_column(Float, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    # Simulated provider only: its process exits 0 after running this long (demos, tests).
    run_for_s: Mapped[int | None] = mapped_column(Integer, default=None)
    # The current run: when it started, and when it ends at the latest (max_runtime_s, or the
    # simulated run's end): `workloads.expire` stops it then; the reconciler finds those missed.
    run_started_at: Mapped[datetime | None] = mapped_column(default=None)
    run_deadline_at: Mapped[datetime | None] = mapped_column(default=None)
    # The seq of its latest event: the next one is known without reading the timeline.
    last_event_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Optimistic concurrency: every UPDATE says `WHERE generation = <what this writer read>`
    # and bumps it, so a writer holding a stale copy fails (StaleDataError) instead of
    # overwriting a newer state.
    generation: Mapped[int] = mapped_column(Integer, default=0)
    # The id of the transaction that last wrote the row, set by a PostgreSQL trigger (see
    # migration 0011; NULL on SQLite): placement reads what changed since its last cycle by
    # this, through the (region, changed_xid) index, instead of every workload holding GPUs.
    changed_xid: Mapped[int | None] = mapped_column(BigInteger, default=None)

    __mapper_args__ = {"version_id_col": generation}


class WorkloadEvent(Base):
    """One row per transition (and per reported checkpoint): the workload's timeline."""

    __tablename__ = "workload_events"
    __tenant_column__ = "tenant_id"
    __table_args__ = (UniqueConstraint("workload_id", "seq"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    workload_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), index=True
    )
    seq: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # transition | checkpoint
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(500))
    details: Mapped[dict] = mapped_column(JSON, default=dict)
    at: Mapped[datetime] = mapped_column()


class TenantQuota(TimestampMixin, Base):
    """Per tenant and GPU model, in GPU-equivalent milli (whole GPU 1000, MIG memory/8, a share
    its milli): `guaranteed` capacity, an optional hard `limit`, and a fair-share weight."""

    __tablename__ = "tenant_quotas"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        UniqueConstraint("tenant_id", "gpu_model"),
        CheckConstraint("guaranteed_milli >= 0", name="guaranteed_nonnegative"),
        CheckConstraint(
            "limit_milli IS NULL OR limit_milli >= guaranteed_milli", name="limit_covers_guarantee"
        ),
        CheckConstraint("weight > 0", name="weight_positive"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    gpu_model: Mapped[str] = mapped_column(String(32))
    guaranteed_milli: Mapped[int] = mapped_column(Integer, default=0)
    limit_milli: Mapped[int | None] = mapped_column(Integer, default=None)
    weight: Mapped[float] = mapped_column(Float, default=1.0)


class Allocation(TimestampMixin, Base):
    """One replica's hold on one node: whole GPUs, a MIG slice or a fractional share. Rows are
    never deleted: `released_at` ends them, so the history can be audited for overlaps."""

    __tablename__ = "allocations"
    __tenant_column__ = "tenant_id"
    __table_args__ = (
        # A workload's live allocations, whatever the planner thinks of `released_at`: without
        # it, PostgreSQL read every live allocation and filtered by workload (seen in a bench).
        Index(
            "ix_allocations_live_by_workload",
            "workload_id",
            postgresql_where=text("released_at IS NULL"),
            sqlite_where=text("released_at IS NULL"),
        ),
        # A tenant's live allocations: what its quotas show as held.
        Index(
            "ix_allocations_live_by_tenant",
            "tenant_id",
            postgresql_where=text("released_at IS NULL"),
            sqlite_where=text("released_at IS NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    workload_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), index=True
    )
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="RESTRICT"))
    replica: Mapped[int] = mapped_column(Integer)
    # The workload's attempt (`Workload.attempts` when it was placed) this hold is for: with
    # (workload_id, replica) it names the one run a node may report about and write logs for.
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    tier: Mapped[str] = mapped_column(String(24))
    gpu_indices: Mapped[list] = mapped_column(JSON)
    mig_profile: Mapped[str | None] = mapped_column(String(8), default=None)
    mig_start: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    milli: Mapped[int] = mapped_column(Integer)  # per GPU: 1000, a MIG slice's, or the share's
    gpu_memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0)
    memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    released_at: Mapped[datetime | None] = mapped_column(default=None)
    # The replica's process, as its node agent reports it (app/agents): running, exited,
    # failed_to_start or lost; NULL until a report (and always, on a simulated node).
    run_state: Mapped[str | None] = mapped_column(String(16), default=None)
    run_pid: Mapped[int | None] = mapped_column(Integer, default=None)
    run_started_at: Mapped[datetime | None] = mapped_column(default=None)
    run_ended_at: Mapped[datetime | None] = mapped_column(default=None)
    exit_code: Mapped[int | None] = mapped_column(SmallInteger, default=None)
    exit_signal: Mapped[str | None] = mapped_column(String(16), default=None)


class GpuUsage(Base):
    """What is held on one GPU, kept by the same transaction that writes allocations. The
    CHECKs make over-commit impossible: a whole GPU adds 1000 milli, so nothing else fits
    beside it; fractional shares add theirs and their memory."""

    __tablename__ = "gpu_usage"
    __table_args__ = (
        CheckConstraint("milli_used >= 0 AND milli_used <= 1000", name="milli_within_gpu"),
        CheckConstraint(
            "memory_used_mib >= 0 AND memory_used_mib <= memory_mib", name="memory_within_gpu"
        ),
        # A GPU being laid out again (MIG) holds nothing: a placement planned before the
        # relayout was asked for is refused here (app/fleet/mig.py).
        CheckConstraint(
            "NOT relayout OR (milli_used = 0 AND memory_used_mib = 0)", name="idle_while_relaid"
        ),
    )

    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    gpu_index: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    milli_used: Mapped[int] = mapped_column(Integer, default=0)
    memory_mib: Mapped[int] = mapped_column(Integer)
    memory_used_mib: Mapped[int] = mapped_column(Integer, default=0)
    relayout: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class MigClaim(Base):
    """One MIG memory slice held by an allocation. Two live claims of one slice cannot exist
    (partial unique index), so MIG placements cannot overlap."""

    __tablename__ = "mig_claims"
    __table_args__ = (
        Index(
            "uq_mig_claims_live_slice",
            "node_id",
            "gpu_index",
            "slice",
            unique=True,
            postgresql_where=text("released_at IS NULL"),
            sqlite_where=text("released_at IS NULL"),
        ),
        CheckConstraint("slice >= 0 AND slice < 8", name="slice_in_gpu"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    allocation_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("allocations.id", ondelete="CASCADE"), index=True
    )
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    gpu_index: Mapped[int] = mapped_column(SmallInteger)
    slice: Mapped[int] = mapped_column(SmallInteger)
    released_at: Mapped[datetime | None] = mapped_column(default=None)


# Upper bounds (seconds) of the placement cycle duration histogram's buckets.
CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def cycle_bucket_column(bound: float) -> str:
    return "le_" + f"{bound:g}".replace(".", "_")


class Volume(TimestampMixin, Base):
    """A tenant's named directory that its runs mount (app/workloads/volumes.py): on each
    node's local disk (`node`: what a run writes stays on that node) or on the fleet's shared
    storage (`shared`: every node that offers it sees the same files). Its directories are named
    by its id, so a volume deleted and made again under its name starts empty."""

    __tablename__ = "volumes"
    __tenant_column__ = "tenant_id"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    storage: Mapped[str] = mapped_column(String(16))  # node | shared


class WorkloadDependency(Base):
    """One workload another waits for (its `depends_on`, an array named there stands for each
    of its elements): read by needs_id when a workload ends, to release or fail its
    dependents."""

    __tablename__ = "workload_dependencies"

    workload_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), primary_key=True
    )
    needs_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class PendingReason(Base):
    """Why a queued workload waits, as the latest placement cycle of its region saw it (as
    Slurm's squeue REASON): `Resources`, `Priority`, `QuotaExhausted`, `FairShare`,
    `NodeNotReady`, `StackDrift`, `MigLayoutPending`, `BackOff`. A row of its own, so that
    the cycle writing it never touches (nor versions) the workload's row; shown only while the
    workload is queued."""

    __tablename__ = "workload_pending"
    __tenant_column__ = "tenant_id"

    workload_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("workloads.id", ondelete="CASCADE"), primary_key=True
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="RESTRICT"), index=True
    )
    reason: Mapped[str] = mapped_column(String(24))
    detail: Mapped[str] = mapped_column(String(300))
    # Since when this reason holds (a changed reason starts again), and the cycle that saw it.
    since: Mapped[datetime] = mapped_column()
    seen_at: Mapped[datetime] = mapped_column()


class PlacementCycleStats(Base):
    """Per region: how many placement cycles ran and how long they took (a cumulative
    histogram, one counter per bucket), added by each cycle in its own transaction, so /metrics
    shows every worker's cycles."""

    __tablename__ = "placement_cycle_stats"

    region: Mapped[str] = mapped_column(String(63), primary_key=True)
    cycles: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds_sum: Mapped[float] = mapped_column(Float, default=0.0)
    le_0_005: Mapped[int] = mapped_column(BigInteger, default=0)
    le_0_01: Mapped[int] = mapped_column(BigInteger, default=0)
    le_0_025: Mapped[int] = mapped_column(BigInteger, default=0)
    le_0_05: Mapped[int] = mapped_column(BigInteger, default=0)
    le_0_1: Mapped[int] = mapped_column(BigInteger, default=0)
    le_0_25: Mapped[int] = mapped_column(BigInteger, default=0)
    le_0_5: Mapped[int] = mapped_column(BigInteger, default=0)
    le_1: Mapped[int] = mapped_column(BigInteger, default=0)
    le_2_5: Mapped[int] = mapped_column(BigInteger, default=0)
    le_5: Mapped[int] = mapped_column(BigInteger, default=0)
    le_10: Mapped[int] = mapped_column(BigInteger, default=0)


class SimulatedFault(Base):
    """A fault of the simulated provider's machines (injected by a chaos experiment): the node
    fails to boot what is provisioned on it, or its GPU resets and reboots fail, until mended.
    Only the simulated provider reads it; a real provider's failures are its own."""

    __tablename__ = "sim_provider_faults"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    node: Mapped[str] = mapped_column(String(63), index=True)
    fails: Mapped[str] = mapped_column(String(8))  # boot | repair
    source: Mapped[uuid.UUID | None] = mapped_column(default=None, index=True)  # experiment
    created_at: Mapped[datetime] = mapped_column()
