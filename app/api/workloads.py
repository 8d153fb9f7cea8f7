from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import Depends, Query, Response
from pydantic import StringConstraints

from app.billing import quotes
from app.core.db import utcnow
from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams, text_query
from app.health.pace import report_step_times
from app.models.tenants import Tenant
from app.models.workloads import Workload, WorkloadEvent
from app.scheduling.lifecycle import State
from app.tenancy.auth import Platform, TenantRead, TenantWrite
from app.tenancy.run_tokens import WorkloadWriter
from app.tenancy.scoping import get_owned
from app.workloads import quotas, reads, service
from app.workloads.replies import (
    AdminWorkloadOut,
    DryRunOut,
    EventOut,
    EventPage,
    ProgressOut,
    QuotaList,
    WorkloadOut,
)
from app.workloads.schemas import (
    CheckpointIn,
    ExitIn,
    Priority,
    ProgressIn,
    QuotaSet,
    WorkloadCreate,
)

router = api_router(prefix="/v1", tags=["workloads"])
# A label filter: `key=value` (no NUL).
LabelPair = Annotated[str, StringConstraints(pattern=r"^[^=\x00]{1,128}=[^\x00]{0,256}$")]
admin = api_router(prefix="/v1/admin", tags=["admin: quotas"])


@router.post(
    "/workloads",
    status_code=201,
    response_model=WorkloadOut,
    summary="Submit a workload: an instance, a VM or a gang job",
)
def submit(
    body: WorkloadCreate, response: Response, auth: TenantWrite, session: DbSession
) -> Workload:
    w = service.submit(session, auth, body)
    response.headers["Location"] = f"/v1/workloads/{w.id}"
    return w


@router.post(
    "/workloads:dry-run",
    response_model=DryRunOut,
    summary="What-if: where a workload would land now, whom it would preempt, or when it starts",
)
def dry_run(body: WorkloadCreate, auth: TenantRead, session: DbSession) -> dict:
    return quotes.dry_run(session, auth, body)  # with its price


@router.get("/workloads", response_model=Page[WorkloadOut], summary="List workloads")
def list_workloads(
    *,
    state: State | None = None,
    active: bool | None = Query(
        None, description="true: not yet ended (queued to running); false: ended"
    ),
    kind: Literal["instance", "vm", "job"] | None = None,
    priority: Priority | None = None,
    label: list[LabelPair] = Query(
        [],
        max_length=20,
        description="`key=value`, repeatable: workloads carrying every one of these labels",
    ),
    array_id: uuid.UUID | None = Query(None, description="A job array's elements (`array.id`)"),
    page: PageParams = Depends(),
    auth: TenantRead,
    session: DbSession,
) -> dict:
    items, nxt = reads.list_workloads(
        session,
        auth,
        page,
        state=state,
        active=active,
        kind=kind,
        priority=priority,
        labels=reads.parse_labels(label),
        array_id=array_id,
    )
    return {"items": items, "next_cursor": nxt}


@router.get("/workloads/{workload_id}", response_model=WorkloadOut, summary="Read a workload")
def read(workload_id: str, auth: TenantRead, session: DbSession) -> Workload:
    w = get_owned(session, auth, Workload, workload_id, what="workload")
    return reads.attach_pending(session, [w])[0]


@router.delete(
    "/workloads/{workload_id}", response_model=WorkloadOut, summary="Terminate a workload"
)
def terminate(workload_id: str, auth: TenantWrite, session: DbSession) -> Workload:
    w = get_owned(session, auth, Workload, workload_id, what="workload", for_update=True)
    service.terminate(session, w)
    return w


@router.get(
    "/workloads/{workload_id}/manifest",
    response_model=dict,
    summary="The Kubernetes manifest a real cluster would run for this placed workload",
)
def manifest(workload_id: str, auth: TenantRead, session: DbSession) -> dict:
    w = get_owned(session, auth, Workload, workload_id, what="workload")
    return reads.manifest(session, w)


@router.get(
    "/workloads/{workload_id}/events",
    response_model=EventPage,
    summary="The workload's timeline: every transition with its reason",
)
def events(workload_id: str, auth: TenantRead, session: DbSession) -> dict:
    w = get_owned(session, auth, Workload, workload_id, what="workload")
    return {"items": reads.events_of(session, auth, w)}


@router.post(
    "/workloads/{workload_id}/checkpoints",
    status_code=201,
    response_model=EventOut,
    summary="Report a completed checkpoint (preemption then loses only later work)",
)
def checkpoint(
    workload_id: str, body: CheckpointIn, auth: WorkloadWriter, session: DbSession
) -> WorkloadEvent:
    w = get_owned(session, auth, Workload, workload_id, what="workload", for_update=True)
    return service.report_checkpoint(
        session, w, body.completed_at, body.size_bytes, body.uri, body.step
    )


@router.post(
    "/workloads/{workload_id}/checkpoint-requests",
    status_code=202,
    response_model=WorkloadOut,
    summary="Ask a running workload for a checkpoint now (its `checkpoint.signal`)",
    description=(
        "Its node agents send each replica the workload's `checkpoint.signal` (default SIGUSR1) "
        "once; it keeps running and reports the checkpoint with `POST .../checkpoints`. 409 "
        "unless it is running."
    ),
)
def request_checkpoint(workload_id: str, auth: TenantWrite, session: DbSession) -> Workload:
    w = get_owned(session, auth, Workload, workload_id, what="workload", for_update=True)
    return service.request_checkpoint(session, w)


@admin.post(
    "/workloads/{workload_id}/exit",
    response_model=WorkloadOut,
    tags=["admin: workloads"],
    summary="A node agent reports that a workload's process exited (0: succeeded; else failed, or "
    "restarted by its restart policy)",
)
def report_exit(workload_id: str, body: ExitIn, auth: Platform, session: DbSession) -> Workload:
    w = get_owned(session, auth, Workload, workload_id, what="workload", for_update=True)
    ok = body.exit_code == 0
    reason = f"the process exited with code {body.exit_code}" + (
        f": {body.message}" if body.message else ""
    )
    at = body.at or utcnow()
    if ok:
        service.finish(
            session,
            w,
            succeeded=True,
            reason=reason,
            at=at,
            details={"exit_code": 0, "cause": "exited"},
        )
    else:  # its own failure: its restart policy says whether it runs again
        service.end_in_failure(
            session,
            w,
            reason=reason,
            at=at,
            details={"exit_code": body.exit_code, "cause": "exited_nonzero"},
        )
    return w


@admin.get(
    "/workloads",
    response_model=Page[AdminWorkloadOut],
    tags=["admin: workloads"],
    summary="Every tenant's workloads, by tenant, state, kind, region, node or priority",
)
def admin_list_workloads(
    *,
    tenant_id: uuid.UUID | None = None,
    state: State | None = None,
    kind: Literal["instance", "vm", "job"] | None = None,
    priority: Priority | None = None,
    region: str | None = text_query(description="Region name"),
    node: str | None = text_query(description="Node name: the workloads holding GPUs on it"),
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = reads.list_workloads(
        session,
        auth,
        page,
        tenant_id=tenant_id,
        state=state,
        kind=kind,
        priority=priority,
        region=region,
        node=node,
    )
    return {"items": items, "next_cursor": nxt}


@router.get("/quotas", response_model=QuotaList, summary="The tenant's quotas and current use")
def my_quotas(auth: TenantRead, session: DbSession) -> dict:
    return quotas.quota_list(session, auth.tenant_id)


@admin.get(
    "/tenants/{tenant_id}/quotas", response_model=QuotaList, summary="A tenant's quotas and use"
)
def tenant_quotas(tenant_id: str, auth: Platform, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    return quotas.quota_list(session, tenant.id)


@admin.put(
    "/tenants/{tenant_id}/quotas",
    response_model=QuotaList,
    summary="Set a tenant's quotas (replaces them): guarantee, hard limit and weight per model",
)
def put_quotas(tenant_id: str, body: QuotaSet, auth: Platform, session: DbSession) -> dict:
    tenant = get_owned(session, auth, Tenant, tenant_id, what="tenant")
    quotas.set_quotas(session, tenant.id, body.quotas)
    return quotas.quota_list(session, tenant.id)


@router.post(
    "/workloads/{workload_id}/progress",
    response_model=ProgressOut,
    summary="Report per-rank step times (a slow rank points at its GPU)",
)
def progress(workload_id: str, body: ProgressIn, auth: WorkloadWriter, session: DbSession) -> dict:
    w = get_owned(session, auth, Workload, workload_id, what="workload", for_update=True)
    slow, unknown, noisy = report_step_times(
        session, w, {r.rank: r.step_time_s for r in body.ranks}
    )
    return {
        "ranks": len(body.ranks),
        "slow_ranks": slow,
        "unknown_ranks": unknown,
        "noisy_neighbour": noisy,
    }
