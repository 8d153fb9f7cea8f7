"""Inference endpoints (app/endpoints): what a tenant serves, and every scaling decision made
for it. An endpoint's replicas are workloads (`Workload.endpoint_id`), placed, run and billed
like any other; where each one serves is on the workload (`serve_host`, `serve_port`,
`serve_ready_at`)."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.core.db import Base, TimestampMixin, new_id


class Endpoint(TimestampMixin, Base):
    """A tenant's inference endpoint: the shape of one replica, where it serves and how it is
    scaled. `target` is the controller's latest decision (how many replicas it should have)."""

    __tablename__ = "endpoints"
    __tenant_column__ = "tenant_id"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=new_id)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    # One replica, as a workload submission (`EndpointReplica`, JSON): checked by the same
    # rules as POST /v1/workloads each time a replica is submitted.
    replica: Mapped[dict] = mapped_column(JSON)
    region: Mapped[str | None] = mapped_column(String(63), default=None)
    priority: Mapped[str] = mapped_column(String(16), default="production")
    port: Mapped[int] = mapped_column(Integer)  # the port a replica serves on, inside it
    ready_path: Mapped[str] = mapped_column(String(200))
    min_replicas: Mapped[int] = mapped_column(Integer)
    max_replicas: Mapped[int] = mapped_column(Integer)
    # The SLO: `p95_ms` (a whole request) or `ttft_ms` (a stream's first token).
    slo_kind: Mapped[str] = mapped_column(String(8))
    slo_ms: Mapped[int] = mapped_column(Integer)
    # The signal scaled on: `concurrency` (requests in flight per replica) or `rps`.
    signal: Mapped[str] = mapped_column(String(16))
    signal_target: Mapped[float] = mapped_column()
    target: Mapped[int] = mapped_column(Integer, default=0)
    target_at: Mapped[datetime | None] = mapped_column(default=None)
    # The autoscaler's memory between ticks (app/endpoints/autoscale.py `Kpa.memory`): when a
    # panic ends, and the stable targets of its scale-down delay.
    scaler_memory: Mapped[dict] = mapped_column(JSON, default=dict)
    # How many replicas it has submitted in all: the next one's name is `<name>-<n>`.
    replicas_made: Mapped[int] = mapped_column(Integer, default=0)


class EndpointEvent(Base):
    """One scaling decision (or a change of the endpoint), with what it was made from."""

    __tablename__ = "endpoint_events"
    __tenant_column__ = "tenant_id"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    endpoint_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("endpoints.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column()
    kind: Mapped[str] = mapped_column(String(16))  # created | updated | scaled
    target: Mapped[int] = mapped_column(Integer)
    mode: Mapped[str] = mapped_column(String(16))  # stable | panic | hold | static | set
    reason: Mapped[str] = mapped_column(String(500))
    inputs: Mapped[dict] = mapped_column(JSON, default=dict)


class EndpointSample(Base):
    """What one gateway saw of one endpoint over one second (app/gateway): the requests in
    flight on average, those that arrived, and the 95th percentile of the latency (or time to
    first byte) of those that ended. The controller sums the gateways' samples of a second
    (a p95 is the worst gateway's) and decides on them; rows past its windows are pruned."""

    __tablename__ = "endpoint_samples"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    endpoint_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("endpoints.id", ondelete="CASCADE"), index=True
    )
    gateway: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(index=True)  # the second's end
    in_flight: Mapped[float] = mapped_column(Float)
    arrivals: Mapped[int] = mapped_column(Integer)
    p95_ms: Mapped[float | None] = mapped_column(Float, default=None)
