"""What the workload routes answer (REST's replies; GraphQL's types are made from them): a workload
with its state, placement, pending reason and connection, its events, and the answers of the
dry run, quotas and checkpoints."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import Field, field_validator, model_validator

from app.core.schemas import (
    OutModel,
)
from app.models.workloads import WorkloadShape
from app.placement.model import cuda_text
from app.workloads.schemas import RestartPolicy


class ElasticOut(OutModel):
    min_replicas: int
    current_replicas: int = Field(
        description="The replicas it is placed or queued at now (its `WORLD_SIZE`)"
    )


def elastic_of(w: Any) -> ElasticOut | None:
    """An elastic gang's bounds and current size, if it is one."""
    if getattr(w, "min_replicas", None) is None:
        return None
    return ElasticOut(min_replicas=w.min_replicas, current_replicas=w.size)


class ArrayOut(OutModel):
    id: uuid.UUID = Field(description="The array's id, shared by its elements")
    index: int = Field(description="This element's index (`RACKPLANE_ARRAY_INDEX`)")
    count: int
    max_parallel: int


class VolumeOut(OutModel):
    id: uuid.UUID
    name: str
    storage: str = Field(description="`node` or `shared`")
    created_at: datetime


class VolumeMountOut(OutModel):
    name: str
    storage: str
    mount_path: str
    read_only: bool


class PendingOut(OutModel):
    reason: str = Field(
        description="As Slurm's REASON: `Resources`, `Priority`, `QuotaExhausted`, "
        "`FairShare`, `NodeNotReady`, `StackDrift`, `MigLayoutPending`, `BackOff`, `Dependency` "
        "(what it depends on has not all succeeded), `ArrayLimit` (its array has "
        "`max_parallel` elements under way), `RuntimeNotOffered` (no node of its models runs "
        "its runtime: their agents do not offer it, or `process` outside the pools the operator "
        "trusts with it)"
    )
    detail: str = Field(description="The same in words, naming nodes where it helps")
    since: datetime = Field(description="Since when this reason holds")


class ConnectOut(OutModel):
    host: str = Field(description="The node's address")
    port: int
    user: str = "root"
    command: str = Field(description="e.g. `ssh -p 22001 root@10.0.0.7`")
    ready: bool = Field(description="Its SSH server has answered (billing ran from boot)")
    ready_at: datetime | None = None


def backing_off_until(w: Any) -> datetime | None:
    """When a queued workload backing off after a restart may be placed again, if it waits."""
    at = getattr(w, "not_before", None)
    if w.state != "queued" or at is None:
        return None
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    return at if at > datetime.now(UTC) else None


def array_of(w: Any) -> ArrayOut | None:
    """The job array a workload is an element of, if any."""
    if getattr(w, "array_id", None) is None:
        return None
    return ArrayOut(
        id=w.array_id,
        index=w.array_index,
        count=w.array_count,
        max_parallel=w.array_max_parallel or w.array_count,
    )


def connect_of(w: Any) -> ConnectOut | None:
    """Where a workload's SSH server is, while its run holds a node's port."""
    if not w.ssh_port or not w.ssh_host or w.state not in ("provisioning", "running"):
        return None
    return ConnectOut(
        host=w.ssh_host,
        port=w.ssh_port,
        command=f"ssh -p {w.ssh_port} root@{w.ssh_host}",
        ready=w.ssh_ready_at is not None,
        ready_at=w.ssh_ready_at,
    )


class WorkloadOut(OutModel):
    id: uuid.UUID
    name: str | None
    kind: str
    state: str
    tier: str
    priority: str
    shape: dict
    replicas: int
    gpu_milli: int
    topology: dict | None
    region: str | None
    stack: str | None = None
    min_cuda: str | None = Field(None, description="The least CUDA version it runs on, if any")
    max_runtime_s: int
    checkpoint_interval_s: int | None
    checkpoint_cost_s: int
    labels: dict[str, str]
    image: str | None
    workdir: str | None = Field(None, description="Where its command starts (see submit's)")
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables set from your secrets, by secret name (never a value)",
    )
    runtime: str = "process"
    ssh_keys: list[str] = Field(
        default_factory=list, description="The SSH public keys it was launched with"
    )
    connect: ConnectOut | None = Field(
        None,
        description="How to log in while it runs (instances and VMs launched with SSH keys): "
        "set when its node's agent has started it, `ready` once its SSH server answers",
    )
    checkpoint_signal: str = "SIGUSR1"
    last_checkpoint_uri: str | None = Field(
        None,
        description="Where its latest checkpoint is: its next run gets it as "
        "`RACKPLANE_RESUME_FROM`",
    )
    last_checkpoint_step: int | None = None
    attempts: int = Field(0, description="How many times it has been placed (runs started)")
    placement: list | None = Field(
        None, description="Per replica: region, rack, node, GPU indices, MIG profile and slot."
    )
    last_checkpoint_at: datetime | None
    started_at: datetime | None
    preempted_at: datetime | None
    preemptions: int
    interruptions: int = Field(description="Hardware faults that stopped it")
    lost_work_gpu_s: float = Field(
        description="Work those faults cost: GPUs x seconds since its last checkpoint, summed"
    )
    expedited: bool = Field(
        description="Requeued after a fault that was not its own: placed ahead of its peers"
    )
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    restarts: dict[str, int] = Field(
        default_factory=dict,
        description="The restarts it has had, by cause (`failure`, `infrastructure`, `preemption`)",
    )
    not_before: datetime | None = Field(
        None,
        description="Backing off after a restart: no placement before this moment (queued only)",
    )
    depends_on: list[uuid.UUID] = Field(
        default_factory=list,
        description="The workloads and arrays that must succeed before it is placed (as given)",
    )
    volumes: list[VolumeMountOut] = Field(
        default_factory=list, description="Your volumes its runs mount (see submit's)"
    )
    array: ArrayOut | None = Field(None, description="The job array it is an element of")
    elastic: ElasticOut | None = Field(None, description="An elastic gang's bounds and size now")
    pending: PendingOut | None = Field(
        None,
        description="Why it waits (queued only), as its region's latest placement cycle saw "
        "it; none before its first cycle",
    )
    finished_at: datetime | None
    run_for_s: int | None
    run_deadline_at: datetime | None = Field(
        description="When the current run ends at the latest (its max_runtime_s, or a "
        "simulated run's length)"
    )
    created_at: datetime

    @model_validator(mode="wrap")
    @classmethod
    def _connect(cls, value: Any, handler: Any) -> WorkloadOut:
        out = handler(value)
        if not isinstance(value, dict):
            if out.connect is None:
                out.connect = connect_of(value)
            out.restarts = dict(getattr(value, "restart_counts", None) or {})
            out.not_before = backing_off_until(value)
            out.array = array_of(value)
            out.elastic = elastic_of(value)
        return out

    @field_validator("ssh_keys", "depends_on", "volumes", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        return value or []

    @field_validator("restart_policy", mode="before")
    @classmethod
    def _policy(cls, value: Any) -> Any:
        return value or {}

    @field_validator("shape", mode="before")
    @classmethod
    def _shape_json(cls, value: Any) -> Any:
        return value.as_json() if isinstance(value, WorkloadShape) else value

    @field_validator("min_cuda", mode="before")
    @classmethod
    def _cuda_text(cls, value: Any) -> Any:
        # Stored as CUDA encodes it (12040), shown as written (12.4).
        return cuda_text(value) if isinstance(value, int) else value


class EventOut(OutModel):
    seq: int
    kind: str = Field(
        description="transition | checkpoint | health (a notice about its GPUs) | ready (its "
        "SSH server answers)"
    )
    from_state: str | None
    to_state: str
    reason: str
    details: dict
    at: datetime


class EventPage(OutModel):
    items: list[EventOut]


class ProgressOut(OutModel):
    ranks: int
    slow_ranks: list[int] = Field(
        description="Ranks slower than the gang's median: their GPUs' speed scores went down"
    )
    unknown_ranks: list[int] = Field(
        description="Ranks past the workload's last (replicas x GPUs - 1): ignored"
    )
    noisy_neighbour: bool = Field(
        description="On a shared GPU: slowed by a neighbour saturating it (the owner is told)"
    )


class QuotaOut(OutModel):
    gpu_model: str
    guaranteed_milli: int
    limit_milli: int | None
    weight: float
    used_milli: int = 0
    queued_milli: int = 0


class QuotaList(OutModel):
    items: list[QuotaOut]


class PlacementOut(OutModel):
    replica: int
    region: str
    rack: str
    node: str
    gpu_indices: list[int]
    gpu_model: str
    mig_profile: str | None
    mig_slot: int | None
    milli: int | None
    gpu_milli: int


class AdminWorkloadOut(WorkloadOut):
    tenant_id: uuid.UUID


class OtherWorkloads(OutModel):
    """Other tenants' workloads, as a tenant may know of them: a count per priority."""

    priority: str
    count: int


class QuoteOut(OutModel):
    """What the placement a dry-run shows would cost at list prices (before commitments)."""

    currency: str | None = Field(description="None when no price covers any of it")
    plan: str = Field(description="`on_demand`, or `preemptible` for preemptible work")
    per_hour: int = Field(description="Minor units (cents) an hour, all replicas together")
    max_cost: int = Field(description="per_hour over its max_runtime_s: the most a run costs")
    unpriced_replicas: int = Field(description="Replicas no price in the book covers")
    budget_left: int | None = Field(
        None,
        description="Your budget's spend limit this month, less what is spent and max_cost "
        "(negative: it would run past the limit); none without a budget in this currency",
    )
    budget_hours: float | None = Field(
        None, description="Hours of it the budget left now would pay for"
    )


class DryRunOut(OutModel):
    placeable_now: bool = Field(..., description="It would be placed by the next cycle.")
    tier: str
    region: str
    placement: list[PlacementOut] = Field(..., description="Where it would land now.")
    preempts: list[uuid.UUID] = Field(..., description="Your workloads it would preempt.")
    preempts_others: list[OtherWorkloads] = Field(
        ..., description="Other tenants' workloads it would preempt: how many of each priority."
    )
    expected_start: datetime | None = Field(
        ...,
        description="Now, after the victims' grace period, or when running work ends; "
        "null if it cannot start under its quota and the fleet.",
    )
    price: QuoteOut | None = Field(
        None, description="The price of the placement it shows (none when it shows none)"
    )
    reason: str = Field(
        description="Why: `fits now`, `preempts lower priority`, `waits for running work to "
        "end`; `waits: ...` (it fits the fleet, but waits for nodes that are out, drifted or "
        "being laid out, named); `does not fit the fleet: ...` (never: a submission is a 422)"
    )
