"""Import every model so `Base.metadata` is complete (Alembic and tests use this)."""

from app.core.db import Base
from app.models.agents import NodeCredential, NodeJoinToken
from app.models.audit import AuditEntry
from app.models.billing import (
    BillingAdjustment,
    Budget,
    BudgetAlert,
    MeterExport,
    MeterExportCursor,
    Price,
)
from app.models.chaos import ChaosExperiment, ChaosInjection
from app.models.endpoints import Endpoint, EndpointEvent, EndpointSample
from app.models.fleet import FleetImport, Gpu, Node, Rack, Region, SoftwareStack
from app.models.health import (
    BurnIn,
    GpuTelemetry,
    HealthEvent,
    HealthIncident,
    HealthRepair,
    IdleIron,
    IdleTime,
    NodeHeartbeat,
)
from app.models.idempotency import IdempotencyRecord
from app.models.keys import ApiKey, SshKey, TenantSecret
from app.models.logs import WorkloadLog, WorkloadLogSize
from app.models.metering import UsageEvent
from app.models.outbox import OutboxMessage
from app.models.sessions import BrowserSession
from app.models.tenants import Tenant
from app.models.workloads import (
    Allocation,
    GpuUsage,
    MigClaim,
    PlacementCycleStats,
    TenantQuota,
    Volume,
    Workload,
    WorkloadDependency,
    WorkloadEvent,
)

__all__ = [
    "Allocation",
    "BurnIn",
    "SoftwareStack",
    "AuditEntry",
    "BillingAdjustment",
    "BrowserSession",
    "Budget",
    "BudgetAlert",
    "MeterExport",
    "MeterExportCursor",
    "Base",
    "ChaosExperiment",
    "Endpoint",
    "EndpointEvent",
    "EndpointSample",
    "ChaosInjection",
    "GpuUsage",
    "MigClaim",
    "ApiKey",
    "TenantSecret",
    "FleetImport",
    "Gpu",
    "GpuTelemetry",
    "HealthEvent",
    "HealthIncident",
    "HealthRepair",
    "IdleIron",
    "IdleTime",
    "NodeCredential",
    "NodeHeartbeat",
    "NodeJoinToken",
    "IdempotencyRecord",
    "Node",
    "OutboxMessage",
    "PlacementCycleStats",
    "Price",
    "Rack",
    "Region",
    "SshKey",
    "Tenant",
    "Volume",
    "WorkloadDependency",
    "TenantQuota",
    "UsageEvent",
    "Workload",
    "WorkloadEvent",
    "WorkloadLog",
    "WorkloadLogSize",
]
