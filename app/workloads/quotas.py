"""Quotas: a tenant's hard limits (checked at submission) and its quotas by GPU model, with
the GPU-equivalents it holds and queues."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.core.errors import ValidationFailed
from app.models.fleet import Node
from app.models.workloads import Allocation, TenantQuota, Workload
from app.placement.catalog import GPU_MODELS
from app.scheduling.lifecycle import State
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import restrict, scoped_select
from app.workloads.replies import QuotaOut
from app.workloads.schemas import QuotaIn, WorkloadCreate


class QuotaLimitExceeded(ValidationFailed):
    code = "quota_limit_exceeded"
    title = "Over the tenant's hard limit"


def quotas_of(session: Session, tenant_id: uuid.UUID) -> dict[str, TenantQuota]:
    rows = session.scalars(scoped_select(tenant_id, TenantQuota))
    return {q.gpu_model: q for q in rows}


def check_limit(auth: AuthContext, body: WorkloadCreate) -> None:
    """A request that no allowed GPU model's hard limit could ever hold is refused now; one
    that only has to wait for the tenant's own work to end queues. The limits are those read
    with the key (kept current by the key cache's epoch)."""
    quotas = dict(auth.quota_limits)
    models = body.gpu_models or list(GPU_MODELS)
    limits = []
    for m in models:
        limit = quotas.get(m)
        if limit is None or body.gpu_milli <= limit:
            return
        limits.append(f"{m}: {limit}")
    raise QuotaLimitExceeded(
        f"The workload needs {body.gpu_milli} GPU-milli; the tenant's hard limit is "
        f"{', '.join(limits)}.",
        needed_milli=body.gpu_milli,
    )


def quota_list(session: Session, tenant_id: uuid.UUID) -> dict[str, Any]:
    """A tenant's quotas by GPU model, each with the GPU-equivalents held and queued; a model
    the tenant holds GPUs of without a quota row is listed too, as it stands for it (nothing
    guaranteed, no limit)."""
    held, queued = usage(session, tenant_id)
    quotas: dict[str, Any] = dict(quotas_of(session, tenant_id))
    for model in held.keys() - quotas.keys():
        quotas[model] = QuotaOut(gpu_model=model, guaranteed_milli=0, limit_milli=None, weight=1.0)
    items = []
    for q in sorted(quotas.values(), key=lambda q: q.gpu_model):
        out = QuotaOut.model_validate(q)
        out.used_milli = held.get(q.gpu_model, 0)
        out.queued_milli = queued.get(q.gpu_model, 0)
        items.append(out)
    return {"items": items}


def set_quotas(session: Session, tenant_id: uuid.UUID, quotas: list[QuotaIn]) -> None:
    """Replace the tenant's quotas with `quotas` (models left out have none)."""
    session.execute(restrict(tenant_id, delete(TenantQuota), TenantQuota))
    for q in quotas:
        session.add(
            TenantQuota(
                tenant_id=tenant_id,
                gpu_model=q.gpu_model,
                guaranteed_milli=q.guaranteed_milli,
                limit_milli=q.limit_milli,
                weight=q.weight,
            )
        )
    session.flush()


def usage(session: Session, tenant_id: uuid.UUID) -> tuple[dict[str, int], dict[str, int]]:
    """(held, queued) GPU-milli per model. Held: the tenant's live allocations (one aggregate on
    their partial index: a tenant may hold thousands); queued: waiting workloads, counted
    against every model they accept."""
    held_milli = func.sum(Allocation.milli * func.json_array_length(Allocation.gpu_indices))
    allocations = select(Node.gpu_model, held_milli).join(Node, Node.id == Allocation.node_id)
    held = {
        model: int(total)
        for model, total in session.execute(
            restrict(tenant_id, allocations, Allocation)
            .where(Allocation.released_at.is_(None))
            .group_by(Node.gpu_model)
        )
    }
    queued: dict[str, int] = {}
    for shape, gpu_milli in session.execute(
        restrict(tenant_id, select(Workload.shape, Workload.gpu_milli), Workload).where(
            Workload.state.in_([State.queued.value, State.pending.value])
        )
    ):
        for m in shape.gpu_models or list(GPU_MODELS):
            queued[m] = queued.get(m, 0) + gpu_milli
    return held, queued
