"""Liveness, readiness and metrics probes (`app/health` is kept for GPU health)."""

from __future__ import annotations

import anyio
from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import text

from app.core.config import get_settings
from app.core.db import get_engine
from app.core.errors import ServiceUnavailable
from app.core.logging import get_logger
from app.core.redis import connect as redis_client
from app.core.routing import api_router

router = api_router(tags=["probes"])
log = get_logger(__name__)


class Health(BaseModel):
    # Named in the OpenAPI document by the module it was first written in (the GPU health enum
    # shares its short name); generated clients know it by that name.
    __module__ = "app.probes.router"

    status: str


class Readiness(BaseModel):
    status: str
    database: str
    broker: str


@router.get("/healthz", response_model=Health, summary="Liveness: the process is up")
def healthz() -> Health:
    return Health(status="ok")


def _check_database() -> None:
    with get_engine().connect() as conn:
        conn.execute(text("SELECT 1"))


def _check_broker() -> None:
    s = get_settings()
    if s.redis_url:
        client = redis_client(s.redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    else:
        from sqlalchemy import create_engine

        engine = create_engine(s.broker_url.removeprefix("sqla+"))
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness: database and broker reachable",
    responses={503: {"description": "A dependency is unreachable (problem+json)"}},
)
async def readyz() -> Readiness:
    failures = {}
    for name, check in (("database", _check_database), ("broker", _check_broker)):
        try:
            with anyio.fail_after(5):
                await anyio.to_thread.run_sync(check)
        except Exception as exc:  # any failure means not ready
            # The driver's text (hosts, ports, users) is for the logs, not for anonymous callers.
            log.warning("not_ready", dependency=name, error=f"{type(exc).__name__}: {exc}"[:300])
            failures[name] = "unreachable"
    if failures:
        raise ServiceUnavailable(
            "Not ready: " + "; ".join(f"{k} unreachable" for k in failures),
            code="not_ready",
            checks=failures,
        )
    return Readiness(status="ready", database="ok", broker="ok")


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}},
)
def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
