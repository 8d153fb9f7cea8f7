"""Metering: GPU-time used by time bucket and the ledger's dimensions, and (operators) the
fleet's allocated against idle GPU-hours. The same reports as REST's /v1/usage routes."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Annotated

import strawberry

from app.graphql.arguments import Granularity, aware
from app.graphql.context import Info
from app.graphql.permissions import IsOperator
from app.graphql.views import shape, view
from app.metering import service as metering_service
from app.metering.schemas import UsageOut, UtilisationOut
from app.tenancy.principal import AuthContext, require_tenant_scope

UsageView = view(UsageOut, "Usage", "GPU-time used, by time bucket and the asked dimensions")
UtilisationView = view(UtilisationOut, "Utilisation", "Allocated vs idle GPU-hours")


@strawberry.enum(description="What usage can be grouped by (the ledger's dimensions)")
class UsageDimension(Enum):
    TENANT_ID = "tenant_id"
    WORKLOAD_ID = "workload_id"
    REGION = "region"
    GPU_MODEL = "gpu_model"
    SHAPE = "shape"
    TIER = "tier"
    PRIORITY = "priority"


def reader(auth: AuthContext) -> None:
    """A tenant key with `read`, or an operator's (fields both may read: prices, capacity)."""
    if not auth.is_platform:
        require_tenant_scope(auth, "read")


@strawberry.type
class MeteringQuery:
    @strawberry.field(description="Your usage by time bucket, grouped by ledger dimensions")
    def usage(
        self,
        info: Info,
        from_: Annotated[datetime, strawberry.argument(name="from")],
        to: datetime,
        granularity: Granularity = Granularity.DAY,
        group_by: list[UsageDimension] | None = None,
    ) -> UsageView:  # type: ignore[valid-type]
        auth = info.context.auth
        reader(auth)
        groups = [g.value for g in group_by or []]
        report = metering_service.usage_report(
            info.context.session,
            metering_service.visible_to(auth),
            aware("from", from_),
            aware("to", to),
            granularity.value,
            groups,
        )
        return shape(UsageOut, report)

    @strawberry.field(
        permission_classes=[IsOperator],
        description="Operators: allocated vs idle GPU-hours by region and model",
    )
    def utilisation(
        self,
        info: Info,
        from_: Annotated[datetime, strawberry.argument(name="from")],
        to: datetime,
        granularity: Granularity = Granularity.DAY,
    ) -> UtilisationView:  # type: ignore[valid-type]
        auth = info.context.auth
        report = metering_service.utilisation_report(
            info.context.session,
            metering_service.visible_to(auth),
            aware("from", from_),
            aware("to", to),
            granularity.value,
        )
        return shape(UtilisationOut, report)
