"""Import every model so `Base.metadata` is complete (Alembic and tests use this)."""

from app.audit.models import AuditEntry
from app.billing.models import (
    BillingAdjustment,
    Budget,
    BudgetAlert,
    MeterExport,
    MeterExportCursor,
    Price,
)
from app.chaos.models import ChaosExperiment, ChaosInjection
from app.core.db import Base
from app.fleet.models import FleetImport, Gpu, Node, Rack, Region
from app.health.models import (
    GpuTelemetry,
    HealthEvent,
    HealthIncident,
    HealthRepair,
    IdleIron,
    IdleTime,
    NodeHeartbeat,
)
from app.idempotency.models import IdempotencyRecord
from app.keys.models import ApiKey
from app.metering.models import UsageEvent
from app.outbox.models import OutboxMessage
from app.sessions.models import BrowserSession
from app.tenants.models import Tenant
from app.workloads.models import (
    Allocation,
    GpuUsage,
    MigClaim,
    PlacementCycleStats,
    TenantQuota,
    Workload,
    WorkloadEvent,
)

__all__ = [
    "Allocation",
    "AuditEntry",
    "BillingAdjustment",
    "BrowserSession",
    "Budget",
    "BudgetAlert",
    "MeterExport",
    "MeterExportCursor",
    "Base",
    "ChaosExperiment",
    "ChaosInjection",
    "GpuUsage",
    "MigClaim",
    "ApiKey",
    "FleetImport",
    "Gpu",
    "GpuTelemetry",
    "HealthEvent",
    "HealthIncident",
    "HealthRepair",
    "IdleIron",
    "IdleTime",
    "NodeHeartbeat",
    "IdempotencyRecord",
    "Node",
    "OutboxMessage",
    "PlacementCycleStats",
    "Price",
    "Rack",
    "Region",
    "Tenant",
    "TenantQuota",
    "UsageEvent",
    "Workload",
    "WorkloadEvent",
]
