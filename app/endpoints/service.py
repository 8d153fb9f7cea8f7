"""Inference endpoints: make, read, change and delete them, and keep each one's replicas at its
target. REST (/v1/endpoints), GraphQL (`endpoints`, `createEndpoint`, ...), the CLI
(`rackplane endpoints`) and the controller (app/endpoints/tasks.py) call these.

A replica is a workload (`kind: instance`, `endpoint_id` set) submitted through the same path
as POST /v1/workloads, so its tier, quota, budget and region are checked by the same rules,
and it is placed, preempted and billed like any other work. The endpoint keeps the target the
autoscaler last decided; `reconcile` submits replicas up to it and terminates those past it."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import Conflict, NotFound, ValidationFailed
from app.core.schemas import RESOURCE_NAME_PATTERN, PageParams, paginate
from app.endpoints.autoscale import Decision
from app.endpoints.schemas import EndpointCreate, EndpointPatch
from app.models.endpoints import Endpoint, EndpointEvent, EndpointSample
from app.models.tenants import Tenant
from app.models.workloads import Workload
from app.scheduling.lifecycle import TERMINAL, State
from app.tenancy.principal import AuthContext
from app.tenancy.principals import tenant_context
from app.tenancy.scoping import Owner, scoped_select
from app.workloads.regions import check_feasible
from app.workloads.schemas import WorkloadCreate
from app.workloads.service import build, submit, terminate

# A replica runs until the endpoint lets it go: the longest run a workload may ask for (the
# controller replaces one that reaches it).
REPLICA_MAX_RUNTIME_S = 30 * 86400
_LIVE = [s.value for s in State if s not in TERMINAL]
_RUNNING = State.running.value


class EndpointExists(Conflict):
    code = "endpoint_exists"
    title = "An endpoint has that name"


def replica_submission(ep_name: str, doc: dict, priority: str, region: str | None, n: int):
    """Replica `n` of an endpoint, as a workload submission (WorkloadCreate's rules apply);
    422 naming the replica's field when they refuse it."""
    try:
        return WorkloadCreate.model_validate(
            {
                **doc,
                "kind": "instance",
                "name": f"{ep_name}-{n}",
                "priority": priority,
                "region": region,
                "labels": {"endpoint": ep_name},
                "max_runtime_s": REPLICA_MAX_RUNTIME_S,
            }
        )
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValidationFailed(
            f"The replica cannot be a workload: {first['msg']}" + (f" ({where})" if where else ""),
            code="invalid_replica",
            field="replica" + (f".{where}" if where else ""),
        ) from None


def _check_replica(session: Session, auth: AuthContext, body: WorkloadCreate) -> None:
    """Refuse now what every replica would be refused later: its tier, hard limit, budget,
    region, stack, secrets and volumes, and a shape the region's fleet could never hold."""
    w = build(session, auth, body)
    check_feasible(session, w, body)


def create_endpoint(session: Session, auth: AuthContext, body: EndpointCreate) -> Endpoint:
    """Make the endpoint and submit its first `min_replicas` replicas; 409 `endpoint_exists`
    when the tenant has one by that name."""
    assert auth.tenant_id is not None
    doc = body.replica.model_dump(mode="json", exclude_defaults=True)
    _check_replica(session, auth, replica_submission(body.name, doc, body.priority, body.region, 0))
    now = utcnow()
    ep = Endpoint(
        tenant_id=auth.tenant_id,
        name=body.name,
        replica=doc,
        region=body.region,
        priority=body.priority,
        port=body.port,
        ready_path=body.ready_path,
        min_replicas=body.min_replicas,
        max_replicas=body.max_replicas,
        target=body.min_replicas,
        target_at=now,
        replicas_made=0,
        created_at=now,
    )
    _set_limits(ep, body.slo.model_dump(), body.scaling.model_dump())
    try:
        with session.begin_nested():
            session.add(ep)
            session.flush()
    except IntegrityError:
        raise EndpointExists(
            f"You have an endpoint named {body.name!r}; change it with PATCH "
            f"/v1/endpoints/{body.name}, or delete it first.",
        ) from None
    _event(session, ep, now, "created", "set", f"made with {ep.min_replicas} replica(s) to start")
    reconcile(session, auth, ep)
    return ep


def _set_limits(ep: Endpoint, slo: dict, scaling: dict) -> None:
    ep.slo_kind = "p95" if slo.get("p95_ms") is not None else "ttft"
    ep.slo_ms = slo["p95_ms"] if ep.slo_kind == "p95" else slo["ttft_ms"]
    ep.signal, ep.signal_target = scaling["signal"], scaling["target"]


def _event(
    session: Session,
    ep: Endpoint,
    at: datetime,
    kind: str,
    mode: str,
    reason: str,
    inputs: dict | None = None,
) -> None:
    session.add(
        EndpointEvent(
            endpoint_id=ep.id,
            tenant_id=ep.tenant_id,
            at=at,
            kind=kind,
            target=ep.target,
            mode=mode,
            reason=reason[:500],
            inputs=inputs or {},
        )
    )


def list_endpoints(
    session: Session, owner: Owner, page: PageParams
) -> tuple[list[Endpoint], str | None]:
    return paginate(session, scoped_select(owner, Endpoint), Endpoint, page)


def get_endpoint(
    session: Session, owner: Owner, name: str, *, for_update: bool = False
) -> Endpoint:
    """One of `owner`'s endpoints by name; 404 `endpoint_not_found` otherwise."""
    if re.fullmatch(RESOURCE_NAME_PATTERN, name) is None:
        raise NotFound("No endpoint has that name.", code="endpoint_not_found")
    stmt = scoped_select(owner, Endpoint).where(Endpoint.name == name)
    row = session.scalar(stmt.with_for_update() if for_update else stmt)
    if row is None:
        raise NotFound(f"You have no endpoint named {name!r}.", code="endpoint_not_found")
    return row


def replicas_of(session: Session, endpoint_ids: list[uuid.UUID]) -> dict[uuid.UUID, list]:
    """The replicas of these endpoints that have not ended, oldest first."""
    out: dict[uuid.UUID, list] = {i: [] for i in endpoint_ids}
    if not endpoint_ids:
        return out
    for w in session.scalars(
        select(Workload)
        .where(Workload.endpoint_id.in_(endpoint_ids), Workload.state.in_(_LIVE))
        .order_by(Workload.created_at, Workload.id)
    ):
        out[w.endpoint_id].append(w)
    return out


def update_endpoint(
    session: Session, auth: AuthContext, name: str, patch: EndpointPatch
) -> Endpoint:
    """Change an endpoint's bounds, SLO or scaling; its target is clipped to the new bounds at
    once (replicas are submitted or let go in the same transaction)."""
    ep = get_endpoint(session, auth, name, for_update=True)
    low = patch.min_replicas if patch.min_replicas is not None else ep.min_replicas
    high = patch.max_replicas if patch.max_replicas is not None else ep.max_replicas
    if low > high:
        raise ValidationFailed(
            f"min_replicas ({low}) would be more than max_replicas ({high}).",
            field="min_replicas",
        )
    slo = patch.slo.model_dump() if patch.slo else _slo_of(ep)
    scaling = patch.scaling.model_dump() if patch.scaling else _scaling_of(ep)
    ep.min_replicas, ep.max_replicas = low, high
    _set_limits(ep, slo, scaling)
    now = utcnow()
    clipped = max(low, min(high, ep.target))
    changed = clipped != ep.target
    ep.target = clipped
    if changed:
        ep.target_at = now
    _event(
        session,
        ep,
        now,
        "updated",
        "set",
        f"bounds {low}..{high}" + (f"; target now {clipped}" if changed else ""),
        {"min_replicas": low, "max_replicas": high, "slo": slo, "scaling": scaling},
    )
    reconcile(session, _as_tenant(session, ep, auth), ep)
    return ep


def delete_endpoint(session: Session, auth: AuthContext, name: str) -> Endpoint:
    """Delete an endpoint: its replicas are terminated (their runs stop with their grace) and
    its record and events go; the replicas' workloads stay, with their usage, for the bill."""
    ep = get_endpoint(session, auth, name, for_update=True)
    for w in _locked_replicas(session, ep):
        terminate(session, w, reason=f"endpoint {ep.name} deleted")
    session.execute(
        update(Workload)
        .where(Workload.endpoint_id == ep.id)
        .values(endpoint_id=None)
        .execution_options(synchronize_session=False)
    )
    session.delete(ep)
    session.flush()
    return ep


def _locked_replicas(session: Session, ep: Endpoint) -> list[Workload]:
    return list(
        session.scalars(
            select(Workload)
            .where(Workload.endpoint_id == ep.id, Workload.state.in_(_LIVE))
            .order_by(Workload.id)
            .with_for_update()
        )
    )


def _as_tenant(session: Session, ep: Endpoint, auth: AuthContext | None) -> AuthContext:
    """Who replicas are submitted as: the tenant's own caller, or (for an operator or the
    controller) the tenant itself with what it may do now."""
    if auth is not None and auth.tenant_id == ep.tenant_id:
        return auth
    tenant = session.get(Tenant, ep.tenant_id)
    assert tenant is not None
    return tenant_context(session, tenant, ep.id, "endpoint", ("write",))


def set_target(session: Session, ep: Endpoint, decision: Decision, now: datetime) -> bool:
    """Record the autoscaler's decision when it changes the target (an event with its inputs);
    whether it did."""
    if decision.target == ep.target:
        return False
    before, ep.target, ep.target_at = ep.target, decision.target, now
    _event(
        session,
        ep,
        now,
        "scaled",
        decision.mode,
        f"{before} -> {decision.target} replica(s) ({decision.mode})",
        decision.inputs,
    )
    return True


def reconcile(session: Session, auth: AuthContext | None, ep: Endpoint) -> tuple[int, int]:
    """Bring the endpoint's replicas to its target: submit those missing, terminate those past
    it (not yet serving first, then the newest). Answers (submitted, terminated)."""
    live = _locked_replicas(session, ep)
    missing = ep.target - len(live)
    if missing > 0:
        acting = _as_tenant(session, ep, auth)
        for _ in range(missing):
            ep.replicas_made += 1
            body = replica_submission(ep.name, ep.replica, ep.priority, ep.region, ep.replicas_made)
            submit(session, acting, body, endpoint_id=ep.id)
        return missing, 0
    # Let go of the least useful first: not serving yet (the newest first), then the newest of
    # those serving.
    waiting = [w for w in live if not _serving(w)]
    serving = [w for w in live if _serving(w)]
    order = [
        *sorted(waiting, key=lambda w: w.created_at, reverse=True),
        *sorted(serving, key=lambda w: w.created_at, reverse=True),
    ]
    gone = order[:-missing] if missing < 0 else []
    for w in gone:
        terminate(session, w, reason=f"endpoint {ep.name} scaled down to {ep.target}")
    return 0, len(gone)


def _serving(w: Workload) -> bool:
    return w.state == _RUNNING and w.serve_ready_at is not None


def _slo_of(ep: Endpoint) -> dict[str, Any]:
    return (
        {"p95_ms": ep.slo_ms, "ttft_ms": None}
        if ep.slo_kind == "p95"
        else {
            "p95_ms": None,
            "ttft_ms": ep.slo_ms,
        }
    )


def _scaling_of(ep: Endpoint) -> dict[str, Any]:
    return {"signal": ep.signal, "target": ep.signal_target}


def endpoint_doc(ep: Endpoint, replicas: list[Workload]) -> dict[str, Any]:
    """An endpoint as its replies show it (EndpointOut)."""
    return {
        "id": ep.id,
        "name": ep.name,
        "url_path": f"/e/{ep.name}/",
        "replica": ep.replica,
        "port": ep.port,
        "ready_path": ep.ready_path,
        "priority": ep.priority,
        "region": ep.region,
        "min_replicas": ep.min_replicas,
        "max_replicas": ep.max_replicas,
        "slo": _slo_of(ep),
        "scaling": _scaling_of(ep),
        "target": ep.target,
        "target_at": ep.target_at,
        "replicas": [
            {
                "workload_id": w.id,
                "name": w.name,
                "state": w.state,
                "ready": _serving(w),
                "host": w.serve_host,
                "port": w.serve_port,
                "ready_at": w.serve_ready_at,
            }
            for w in replicas
        ],
        "created_at": ep.created_at,
    }


def events_of(session: Session, owner: Owner, name: str, limit: int = 100) -> list[EndpointEvent]:
    """An endpoint's latest events, newest first."""
    ep = get_endpoint(session, owner, name)
    return list(
        session.scalars(
            select(EndpointEvent)
            .where(EndpointEvent.endpoint_id == ep.id)
            .order_by(EndpointEvent.id.desc())
            .limit(limit)
        )
    )


def wake(session: Session, endpoint_id: uuid.UUID, held: int, now: datetime) -> bool:
    """A gateway holds requests for an endpoint with no replica (Knative's activator): ask for
    one now rather than at the controller's next look, and record the load that asked (so the
    controller, deciding on what gateways saw, keeps it). Whether the target went up."""
    ep = session.scalar(select(Endpoint).where(Endpoint.id == endpoint_id).with_for_update())
    if ep is None or ep.target > 0 or ep.max_replicas < 1:
        return False
    session.add(
        EndpointSample(
            endpoint_id=ep.id, gateway="activator", at=now, in_flight=held, arrivals=held
        )
    )
    set_target(session, ep, Decision(1, "activator", {"held": held}), now)
    reconcile(session, None, ep)
    return True
