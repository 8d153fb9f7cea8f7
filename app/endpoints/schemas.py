"""The shapes of inference endpoints on the wire (REST; GraphQL's views are made from them)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import Field, create_model, model_validator

from app.core.schemas import RESOURCE_NAME_PATTERN, OutModel, StrictModel, strict_schema
from app.workloads.schemas import Priority, WorkloadCreate

# What of a workload submission describes one replica: its shape, tier and what it runs. The
# fields are WorkloadCreate's own (one definition); the rest of a submission (kind, name,
# replicas, priority, region, labels) the endpoint sets.
REPLICA_FIELDS = (
    "gpu_models",
    "gpus",
    "mig_profile",
    "milli",
    "gpu_memory_mib",
    "cpu_milli",
    "memory_mib",
    "isolation",
    "runtime",
    "stack",
    "image",
    "workdir",
    "command",
    "env",
    "secret_env",
    "volumes",
)

EndpointReplica: Any = create_model(  # type: ignore[call-overload]
    "EndpointReplica",
    __base__=StrictModel,
    __doc__="One replica: its GPUs (whole, a MIG profile or a share), its isolation tier, and "
    "what it runs (a command, or an image), as in a workload submission (POST /v1/workloads). "
    "The server it starts listens on `$PORT` (a process run) or on the endpoint's `port` (a "
    "container).",
    **{
        n: (WorkloadCreate.model_fields[n].annotation, WorkloadCreate.model_fields[n])
        for n in REPLICA_FIELDS
    },
)


MAX_SLO_MS = 600_000


def _one_slo(schema: dict[str, Any], model: type) -> None:
    """Exactly one of the two, stated in the JSON Schema so clients and fuzzers see it."""
    strict_schema(schema, model)
    null, ms = {"type": "null"}, {"type": "integer", "minimum": 1, "maximum": MAX_SLO_MS}
    schema["oneOf"] = [
        {"required": ["p95_ms"], "properties": {"p95_ms": ms, "ttft_ms": null}},
        {"required": ["ttft_ms"], "properties": {"ttft_ms": ms, "p95_ms": null}},
    ]


class EndpointSlo(StrictModel):
    """What is sold: a latency each request keeps to, at the 95th percentile. Exactly one."""

    model_config = {**StrictModel.model_config, "json_schema_extra": _one_slo}

    p95_ms: int | None = Field(
        None, ge=1, le=MAX_SLO_MS, description="A whole request's latency, 95th percentile"
    )
    ttft_ms: int | None = Field(
        None, ge=1, le=MAX_SLO_MS, description="A stream's time to its first byte, 95th percentile"
    )

    @model_validator(mode="after")
    def _one(self) -> EndpointSlo:
        if (self.p95_ms is None) == (self.ttft_ms is None):
            raise ValueError("Give exactly one of `p95_ms` and `ttft_ms`.")
        return self


class EndpointScaling(StrictModel):
    """What the autoscaler scales on, and how much of it one replica takes."""

    signal: Literal["concurrency", "rps"] = Field(
        "concurrency",
        description="`concurrency`: requests in flight per replica (Knative's and Ray Serve's "
        "target); `rps`: requests a second per replica (SkyServe's `target_qps_per_replica`)",
    )
    target: float = Field(4.0, gt=0, le=10_000, description="Per replica")


class EndpointLimits(StrictModel):
    """The bounds of an endpoint's replicas, and how it scales: what PATCH may change."""

    min_replicas: int = Field(
        0, ge=0, le=64, description="Replicas it keeps however quiet it is (0: scale to zero)"
    )
    max_replicas: int = Field(1, ge=1, le=64, description="Replicas it never exceeds")
    slo: EndpointSlo = Field(default_factory=lambda: EndpointSlo(p95_ms=1000))
    scaling: EndpointScaling = Field(default_factory=EndpointScaling)

    @model_validator(mode="after")
    def _bounds(self) -> EndpointLimits:
        if self.min_replicas > self.max_replicas:
            raise ValueError("`min_replicas` is more than `max_replicas`.")
        return self


class EndpointCreate(EndpointLimits):
    """An inference endpoint: replicas of one shape, serving HTTP on `port`, reached through
    the gateway at `/e/{name}/...`, scaled between `min_replicas` and `max_replicas`."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=63,
        pattern=RESOURCE_NAME_PATTERN,
        description="Unique in your account; callers reach it at `/e/{name}/`",
        examples=["chat"],
    )
    replica: EndpointReplica  # type: ignore[valid-type]
    port: int = Field(
        8000, ge=1, le=65_535, description="The port a replica serves on (inside a container)"
    )
    ready_path: str = Field(
        "/healthz",
        max_length=200,
        pattern=r"^/[A-Za-z0-9._~/?=&%+-]*$",
        description="A replica takes requests once a GET of this path answers 2xx",
    )
    priority: Priority = Field(
        "production",
        description="Its replicas' priority class: `production` may preempt lower classes' "
        "preemptible work (which resumes from its checkpoint)",
    )
    region: str | None = Field(None, max_length=63)


class EndpointPatch(StrictModel):
    """What changes on an endpoint: its bounds, its SLO and how it scales (fields left out
    stay as they are)."""

    min_replicas: int | None = Field(None, ge=0, le=64)
    max_replicas: int | None = Field(None, ge=1, le=64)
    slo: EndpointSlo | None = None
    scaling: EndpointScaling | None = None


class EndpointReplicaOut(OutModel):
    workload_id: uuid.UUID
    name: str | None
    state: str
    ready: bool = Field(description="It answers its readiness path: the gateway routes to it")
    host: str | None = Field(None, description="The node's address it serves on")
    port: int | None = None
    ready_at: datetime | None = None


class EndpointOut(OutModel):
    id: uuid.UUID
    name: str
    url_path: str = Field(description="Where the gateway takes its requests: `/e/{name}/`")
    replica: dict
    port: int
    ready_path: str
    priority: str
    region: str | None
    min_replicas: int
    max_replicas: int
    slo: EndpointSlo
    scaling: EndpointScaling
    target: int = Field(description="How many replicas the autoscaler wants now")
    target_at: datetime | None = None
    replicas: list[EndpointReplicaOut] = Field(
        default_factory=list, description="Its replicas that have not ended"
    )
    created_at: datetime


class EndpointEventOut(OutModel):
    id: int
    at: datetime
    kind: str = Field(description="`created`, `updated` or `scaled`")
    target: int
    mode: str = Field(description="How it was decided: `stable`, `panic`, `hold`, `set`, ...")
    reason: str
    inputs: dict = Field(description="What the decision was made from")
