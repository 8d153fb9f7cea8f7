"""/v1/endpoints: a tenant's inference endpoints (app/endpoints/service.py), by name: replicas
of one shape serving HTTP, reached through the gateway at `/e/{name}/`, scaled between their
bounds by the autoscaler."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query

from app.core.routing import DbSession, api_router
from app.core.schemas import RESOURCE_NAME_PATTERN, Page, PageParams
from app.endpoints.schemas import EndpointCreate, EndpointEventOut, EndpointOut, EndpointPatch
from app.endpoints.service import (
    create_endpoint,
    delete_endpoint,
    endpoint_doc,
    events_of,
    get_endpoint,
    list_endpoints,
    replicas_of,
    update_endpoint,
)
from app.tenancy.auth import TenantRead, TenantWrite

router = api_router(prefix="/v1", tags=["endpoints"])

EndpointName = Annotated[
    str,
    Path(
        pattern=RESOURCE_NAME_PATTERN,
        description="The endpoint's name: letters, digits, `.`, `_` and `-` (1 to 63)",
    ),
]


@router.post(
    "/endpoints",
    status_code=201,
    response_model=EndpointOut,
    summary="Make an inference endpoint (409 `endpoint_exists` when you have one by that name; "
    "422 `invalid_replica` when its replica could not be a workload)",
)
def create(body: EndpointCreate, auth: TenantWrite, session: DbSession) -> dict:
    ep = create_endpoint(session, auth, body)
    return endpoint_doc(ep, replicas_of(session, [ep.id])[ep.id])


@router.get("/endpoints", response_model=Page[EndpointOut], summary="List your endpoints")
def list_all(*, page: PageParams = Depends(), auth: TenantRead, session: DbSession) -> dict:
    items, nxt = list_endpoints(session, auth, page)
    replicas = replicas_of(session, [e.id for e in items])
    return {"items": [endpoint_doc(e, replicas[e.id]) for e in items], "next_cursor": nxt}


@router.get(
    "/endpoints/{endpoint_name}",
    response_model=EndpointOut,
    summary="Read an endpoint: its bounds, its target and its replicas with their states",
)
def read(endpoint_name: EndpointName, auth: TenantRead, session: DbSession) -> dict:
    ep = get_endpoint(session, auth, endpoint_name)
    return endpoint_doc(ep, replicas_of(session, [ep.id])[ep.id])


@router.patch(
    "/endpoints/{endpoint_name}",
    response_model=EndpointOut,
    summary="Change an endpoint's bounds, SLO or scaling (its target is clipped to the new "
    "bounds at once)",
)
def patch(
    endpoint_name: EndpointName, body: EndpointPatch, auth: TenantWrite, session: DbSession
) -> dict:
    ep = update_endpoint(session, auth, endpoint_name, body)
    return endpoint_doc(ep, replicas_of(session, [ep.id])[ep.id])


@router.delete(
    "/endpoints/{endpoint_name}",
    status_code=204,
    summary="Delete an endpoint (its replicas are terminated; their usage stays on the bill)",
)
def delete(endpoint_name: EndpointName, auth: TenantWrite, session: DbSession) -> None:
    delete_endpoint(session, auth, endpoint_name)


@router.get(
    "/endpoints/{endpoint_name}/events",
    response_model=list[EndpointEventOut],
    summary="An endpoint's scaling decisions and changes, newest first, each with its inputs",
)
def events(
    endpoint_name: EndpointName,
    auth: TenantRead,
    session: DbSession,
    limit: int = Query(100, ge=1, le=1000),
) -> list:
    return events_of(session, auth, endpoint_name, limit)
