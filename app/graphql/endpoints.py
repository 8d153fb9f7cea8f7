"""Inference endpoints: the caller's, their scaling decisions, and making, changing and
deleting one, as REST's /v1/endpoints routes (the same service calls, the same error codes)."""

from __future__ import annotations

import strawberry

from app.endpoints import service
from app.endpoints.schemas import EndpointCreate, EndpointEventOut, EndpointOut, EndpointPatch
from app.graphql.context import Info
from app.graphql.pagination import Connection, connection, page_params
from app.graphql.permissions import TenantRead
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.tenancy.principal import require_tenant_scope

Endpoint = view(EndpointOut, "Endpoint", "An inference endpoint of yours and its replicas")
EndpointEvent = view(
    EndpointEventOut, "EndpointEvent", "A scaling decision or change, with its inputs"
)
EndpointInput = input_view(EndpointCreate, "EndpointInput")
EndpointPatchInput = input_view(EndpointPatch, "EndpointPatchInput")
EndpointResult = result_union("EndpointResult", Endpoint)


def _out(session, ep) -> Endpoint:  # type: ignore[valid-type]
    doc = service.endpoint_doc(ep, service.replicas_of(session, [ep.id])[ep.id])
    return shape(EndpointOut, doc)


@strawberry.type
class EndpointQuery:
    @strawberry.field(
        permission_classes=[TenantRead], description="Your endpoints (REST: GET /v1/endpoints)"
    )
    def endpoints(
        self, info: Info, first: int = 50, after: str | None = None
    ) -> Connection[Endpoint]:  # type: ignore[valid-type]
        session = info.context.session
        rows, nxt = service.list_endpoints(session, info.context.auth, page_params(first, after))
        replicas = service.replicas_of(session, [r.id for r in rows])
        return connection(
            rows, lambda r: shape(EndpointOut, service.endpoint_doc(r, replicas[r.id])), nxt
        )

    @strawberry.field(
        permission_classes=[TenantRead],
        description="One of your endpoints by name (REST: GET /v1/endpoints/{name})",
    )
    def endpoint(self, info: Info, name: str) -> Endpoint:  # type: ignore[valid-type]
        ep = service.get_endpoint(info.context.session, info.context.auth, name)
        return _out(info.context.session, ep)

    @strawberry.field(
        permission_classes=[TenantRead],
        description="An endpoint's scaling decisions and changes, newest first (REST: GET "
        "/v1/endpoints/{name}/events)",
    )
    def endpoint_events(self, info: Info, name: str, first: int = 100) -> list[EndpointEvent]:  # type: ignore[valid-type]
        rows = service.events_of(
            info.context.session, info.context.auth, name, max(1, min(first, 1000))
        )
        return [shape(EndpointEventOut, r) for r in rows]


@strawberry.type
class EndpointMutation:
    @strawberry.mutation(
        description="Make an inference endpoint (REST: POST /v1/endpoints); `endpoint_exists` "
        "when you have one by that name, `invalid_replica` when its replica could not be a "
        "workload"
    )
    def create_endpoint(self, info: Info, input: EndpointInput) -> EndpointResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(EndpointCreate, input)
            ep = service.create_endpoint(ctx.session, ctx.auth, body)
            return {"name": body.name}, ep, _out(ctx.session, ep)

        return run_mutation(info, "createEndpoint", act)

    @strawberry.mutation(
        description="Change an endpoint's bounds, SLO or scaling (REST: PATCH /v1/endpoints/{name})"
    )
    def update_endpoint(self, info: Info, name: str, input: EndpointPatchInput) -> EndpointResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(EndpointPatch, input)
            ep = service.update_endpoint(ctx.session, ctx.auth, name, body)
            return {"name": name, **body.model_dump(exclude_none=True)}, ep, _out(ctx.session, ep)

        return run_mutation(info, "updateEndpoint", act)

    @strawberry.mutation(
        description="Delete an endpoint (REST: DELETE /v1/endpoints/{name}); its replicas are "
        "terminated"
    )
    def delete_endpoint(self, info: Info, name: str) -> EndpointResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            ep = service.get_endpoint(ctx.session, ctx.auth, name)
            answer = _out(ctx.session, ep)
            service.delete_endpoint(ctx.session, ctx.auth, name)
            return {"name": name}, ep, answer

        return run_mutation(info, "deleteEndpoint", act)
