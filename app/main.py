"""create_app(): routers, middleware, error handlers."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline

from app import models  # noqa: F401  (register every model)
from app.api import (
    agents,
    audit,
    billing,
    chaos,
    endpoints,
    fleet,
    health,
    keys,
    logs,
    metering,
    probes,
    secrets,
    sessions,
    ssh_keys,
    stacks,
    tenants,
    upgrades,
    volumes,
    workloads,
)
from app.audit import service as audit_service
from app.core.config import get_settings
from app.core.errors import install_error_handlers
from app.core.logging import configure_logging
from app.core.middleware import (
    BodySizeLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RequestContextMiddleware,
    TransientRetryMiddleware,
)
from app.core.routing import AFTER_COMMIT, BEFORE_COMMIT
from app.core.secrets import check_server_secrets
from app.fleet import upgrades as fleet_upgrades
from app.fleet.document import FleetDocument
from app.graphql.schema import router as graphql_router
from app.health import metrics as health_metrics
from app.health import suite
from app.health.schemas import TelemetryBatch
from app.idempotency.middleware import IdempotencyMiddleware
from app.idempotency.middleware import before_commit as idempotency_applied
from app.portal.router import router as portal_router
from app.ratelimit.service import RateLimitHeadersMiddleware

DESCRIPTION = """Rackplane: the control plane of a multi-tenant GPU cloud.

Authenticate with an API key: `Authorization: Bearer rp_...`. Errors are RFC 9457
`application/problem+json` with a stable `code`. Lists use cursor pagination (`limit`, `cursor`,
`next_cursor`). POSTs honour `Idempotency-Key`.
"""


@asynccontextmanager
async def _lifespan(_app: FastAPI) -> AsyncIterator[None]:
    # Refuse to serve without the server secrets (on PostgreSQL they must be configured).
    check_server_secrets()
    # What start-up built (the app, its schemas, the ORM's mappers) lives as long as the
    # process: out of the collector's sight, a full collection no longer walks it on a request.
    gc.collect()
    gc.freeze()
    yield
    # Anonymous refusals counted in windows still open are written before the process ends.
    await anyio.to_thread.run_sync(audit_service.flush_refusals)


def create_app() -> FastAPI:
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_json, settings.log_file)
    suite.check_suite()  # an unusable burn-in suite file stops the API here, named
    fleet_upgrades.check_commands()  # and so does an unusable upgrade commands file
    # /docs and /redoc with their assets served by the app: no CDN, so they work offline.
    app = FastAPIOffline(
        title="Rackplane", version="0.1.0", description=DESCRIPTION, lifespan=_lifespan
    )
    install_error_handlers(app)
    health_metrics.register()  # fleet and health state on /metrics, read at scrape time
    _routes(app)
    _commit_hooks()
    _middleware(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _routes(app: FastAPI) -> None:
    # Routes match in order, one by one: the hottest (workloads) first.
    for module in (
        workloads,
        probes,
        tenants,
        keys,
        ssh_keys,
        secrets,
        volumes,
        endpoints,
        fleet,
        metering,
        billing,
        audit,
        health,
        chaos,
        sessions,
        agents,
        logs,
        stacks,
        upgrades,
    ):
        if hasattr(module, "router"):
            app.include_router(module.router)
        if hasattr(module, "admin"):
            app.include_router(module.admin)
    # The portal's GraphQL API beside REST (not in the OpenAPI document: its schema is
    # sdl/schema.graphql).
    app.include_router(graphql_router(), prefix="/graphql", include_in_schema=False)
    # The portal's page and its assets (not API: not in the OpenAPI document).
    app.include_router(portal_router)


def _commit_hooks() -> None:
    # The audit entry of a request that commits is written in its transaction (routing hook).
    if audit_service.before_commit not in BEFORE_COMMIT:
        BEFORE_COMMIT.append(audit_service.before_commit)
        AFTER_COMMIT.append(audit_service.committed)
    # ...and so is the mark that a request sent with an Idempotency-Key was applied.
    if idempotency_applied not in BEFORE_COMMIT:
        BEFORE_COMMIT.append(idempotency_applied)


def _middleware(app: FastAPI) -> None:
    settings = get_settings()
    # Outermost last: request context wraps everything, then the in-flight bound, the audit of
    # what got in, size limits, idempotency, and innermost the re-run of an idempotent request
    # that a backing service's failover broke.
    app.add_middleware(TransientRetryMiddleware)
    app.add_middleware(IdempotencyMiddleware)
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        large_paths={
            "/v1/admin/fleet:import": settings.max_import_bytes,
            "/v1/admin/telemetry": settings.max_telemetry_bytes,
            "/v1/agent/telemetry": settings.max_agent_telemetry_bytes,
            "/v1/agent/logs": settings.max_agent_log_bytes,
        },
    )
    # Telemetry is data, not anyone's decision: what it causes is in the health history.
    # So are workload logs and agents' run reports (what they cause is in the workloads'
    # timelines). GraphQL's mutations write their entries where they commit; its queries are
    # reads.
    app.add_middleware(
        audit_service.AuditMiddleware,
        exempt=frozenset(
            {"/v1/admin/telemetry", "/v1/agent/logs", "/v1/agent/status", "/v1/agent/telemetry"}
        ),
        commits_only=frozenset({"/graphql"}),
    )
    app.add_middleware(
        ConcurrencyLimitMiddleware,
        limit=settings.api_max_in_flight,
        timeout=settings.api_queue_timeout_seconds,
        exempt=frozenset({"/healthz", "/readyz", "/metrics"}),
    )
    app.add_middleware(RateLimitHeadersMiddleware)
    app.add_middleware(RequestContextMiddleware)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, made once: the routes' own, the bodies read raw by hand, and
    the problem responses."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    # Bodies read raw (YAML or JSON; JSON or Prometheus text): their schemas by hand.
    for model in (FleetDocument, TelemetryBatch):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    _problem_responses(schema)
    app.openapi_schema = schema
    return schema


def _problem_responses(schema: dict[str, Any]) -> None:
    """Document problem+json on every operation (errors share one Problem schema)."""
    schema["components"]["schemas"]["Problem"] = {
        "type": "object",
        "title": "Problem",
        "description": "RFC 9457 problem details.",
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "code": {"type": "string"},
            "instance": {"type": "string"},
            "errors": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["type", "title", "status", "detail", "code"],
    }
    problem = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            if "422" in responses:
                responses["422"] = {"description": "Validation error", "content": problem}
            codes = ["413"] if op.get("requestBody") else []
            if op.get("security"):
                codes += ["401", "403", "404"]
            for code in codes:
                responses.setdefault(code, {"description": "Problem", "content": problem})
            responses.setdefault("default", {"description": "Problem", "content": problem})


app = create_app()
