"""Reading workloads: the list (REST's and GraphQL's) and its filters, a workload's timeline,
and the Kubernetes manifest a placed one would run as."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import Conflict, ValidationFailed
from app.core.schemas import PageParams, paginate
from app.models.fleet import Node
from app.models.tenants import Tenant
from app.models.workloads import Allocation, Workload, WorkloadEvent
from app.scheduling.lifecycle import HOLDING, TERMINAL, State
from app.scheduling.pending import reasons_of
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import restrict, scoped_select


def list_workloads(
    session: Session,
    auth: AuthContext,
    page: PageParams,
    *,
    state: State | None = None,
    active: bool | None = None,
    kind: str | None = None,
    priority: str | None = None,
    labels: dict[str, str] | None = None,
    tenant_id: uuid.UUID | None = None,
    region: str | None = None,
    node: str | None = None,
    array_id: uuid.UUID | None = None,
) -> tuple[list[Workload], str | None]:
    """The caller's workloads (every tenant's for operators), oldest first, a page at a time:
    REST's list and GraphQL's connection; filtered by state (or `active`: not yet ended, or
    ended), kind, priority, labels (each `key: value` must be carried) and job array."""
    stmt = scoped_select(auth, Workload)
    if state is not None:
        stmt = stmt.where(Workload.state == state.value)
    if active is not None:
        ended = Workload.state.in_([t.value for t in TERMINAL])
        stmt = stmt.where(~ended if active else ended)
    if kind is not None:
        stmt = stmt.where(Workload.kind == kind)
    if priority is not None:
        stmt = stmt.where(Workload.priority == str(priority))
    for key, value in (labels or {}).items():
        stmt = stmt.where(Workload.labels[key].as_string() == value)
    if tenant_id is not None:
        stmt = restrict(tenant_id, stmt, Workload)
    if region is not None:
        stmt = stmt.where(Workload.region == region)
    if array_id is not None:  # a job array's elements
        stmt = stmt.where(Workload.array_id == array_id)
    if node is not None:  # the workloads holding GPUs on it
        stmt = stmt.where(
            Workload.id.in_(
                select(Allocation.workload_id)
                .join(Node, Node.id == Allocation.node_id)
                .where(Node.name == node, Allocation.released_at.is_(None))
            )
        )
    items, nxt = paginate(session, stmt, Workload, page)
    attach_pending(session, items)
    return items, nxt


def attach_pending(session: Session, ws: list[Workload]) -> list[Workload]:
    """Give each queued workload of `ws` why it waits (`w.pending`, as its region's last
    placement cycle saw it: app/scheduling/pending.py), in one read; the others none."""
    queued = [w for w in ws if w.state == State.queued.value]
    found = reasons_of(session, [w.id for w in queued])
    for w in ws:
        row = found.get(w.id) if w.state == State.queued.value else None
        w.pending = (  # type: ignore[attr-defined]
            {"reason": row.reason, "detail": row.detail, "since": row.since} if row else None
        )
    return ws


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """`["team=ml", "env=prod"]` -> a label filter; a pair without `=` is a 422."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValidationFailed(
                f"A label filter is key=value, not {pair!r}.", code="validation_error"
            )
        out[key] = value
    return out


def events_of(session: Session, auth: AuthContext, w: Workload) -> list[WorkloadEvent]:
    """A workload's timeline, in order."""
    return list(
        session.scalars(
            scoped_select(auth, WorkloadEvent)
            .where(WorkloadEvent.workload_id == w.id)
            .order_by(WorkloadEvent.seq)
        )
    )


PLACED = {s.value for s in HOLDING}


class NotPlaced(Conflict):
    code = "workload_not_placed"
    title = "The workload is not placed"


def manifest(session: Session, w: Workload) -> dict[str, Any]:
    """The Kubernetes manifest a real cluster would run for this placed workload."""
    if not w.placement or w.state not in PLACED:
        raise NotPlaced(
            f"A {w.state} workload holds no GPUs, so it has no manifest.", state=w.state
        )
    tenant = session.get(Tenant, w.tenant_id)
    names = {p["node"] for p in w.placement}
    domains = dict(
        session.execute(select(Node.name, Node.nvlink_domain).where(Node.name.in_(names))).all()
    )
    # Here, not at the top: the Kubernetes client is ~970 modules and 34 MB that every API and
    # worker process would load for this one rarely asked route.
    from app.workloads import k8s

    return k8s.manifest(w, tenant.slug, domains)
