from __future__ import annotations

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import get_or_404, utcnow
from app.core.errors import PayloadTooLarge, ValidationFailed
from app.core.routing import DbSession, api_router
from app.health import burnin, telemetry
from app.health.operators import act
from app.health.schemas import (
    BringUp,
    FleetHealth,
    HealthActionIn,
    HealthActionOut,
    HealthHistory,
    TelemetryBatch,
    TelemetryResult,
)
from app.health.views import history, summary
from app.models.fleet import Gpu, Node
from app.tenancy.auth import Platform

admin = api_router(prefix="/v1/admin", tags=["admin: health"])

PROMETHEUS_TYPES = ("text/plain", "application/openmetrics-text")
# The text exposition format, line by line: comments, and `name{label="value",...} value [ms]`.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*"'
_SAMPLE = (
    r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    rf"(\{{({_LABEL}(,{_LABEL})*,?)?\}})?"
    r"[ \t]+[-+]?([0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|Inf|NaN)"
    r"([ \t]+-?[0-9]{1,15})?"
)
EXPOSITION_PATTERN = rf"^((#[^\n]*|{_SAMPLE})?\n)*$"
_TELEMETRY_BODY = {
    "requestBody": {
        "required": True,
        "description": (
            "JSON samples, or the Prometheus text dcgm-exporter serves, as it is (labels "
            "`Hostname` and `gpu`, or `UUID`, name the GPU)."
        ),
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/TelemetryBatch"}},
            "text/plain": {"schema": {"type": "string", "pattern": EXPOSITION_PATTERN}},
        },
    }
}


async def _raw_body(request: Request, _caller: Platform) -> bytes:
    """The body, read only once the caller's key has been checked (an operator's): read
    first, a caller with no key made the server take in a 30 MiB body before its 401."""
    raw = await request.body()
    limit = get_settings().max_telemetry_bytes
    if len(raw) > limit:
        raise PayloadTooLarge(f"Telemetry batches are limited to {limit} bytes.")
    return raw


@admin.post(
    "/telemetry",
    response_model=TelemetryResult,
    openapi_extra=_TELEMETRY_BODY,
    summary="Push GPU telemetry (DCGM samples; dcgm-exporter text as it is)",
    description=(
        "Node agents push what DCGM reads. Samples of GPUs the fleet does not know are listed "
        "back (the first 100, and a count) and the rest are taken in; so are samples rejected "
        "for bad data (a value outside its field's domain, a timestamp far ahead, a malformed "
        "label, a UUID that is another GPU's), which are never acted on. A malformed batch is "
        "a 422 naming the sample, and nothing of it is kept. Each pushing node counts as alive "
        "(a heartbeat); fault signals (Xids, ECC and NVLink errors, the driver's recovery "
        "action...) go to the health loop at once."
    ),
)
def push_telemetry(
    *, request: Request, raw: bytes = Depends(_raw_body), auth: Platform, session: DbSession
) -> dict:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationFailed("Telemetry must be UTF-8 text.", code="malformed_sample") from None
    if ctype in PROMETHEUS_TYPES:
        samples, targets = telemetry.parse_exposition(text)
        result = telemetry.ingest(session, samples, targets)
    elif ctype == "application/json" or ctype.endswith("+json") or not ctype:
        result = _ingest_json(session, text)
    else:
        raise ValidationFailed(
            f"Content-Type {ctype} is not one this endpoint reads: send application/json, or "
            "text/plain (Prometheus text exposition).",
            code="unsupported_media_type",
        )
    return result.reply()


def _ingest_json(session: Session, text: str) -> telemetry.IngestResult:
    try:
        batch = TelemetryBatch.model_validate_json(text)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
        ) from None
    targets: dict = {}
    samples = []
    for i, s in enumerate(batch.samples):
        key = (s.node, None if s.gpu is None else str(s.gpu), s.uuid)
        targets.setdefault(key, key)
        ts = s.timestamp.timestamp() if s.timestamp is not None else None
        samples.append((i, key, s.field, s.value, ts))
    return telemetry.ingest(session, samples, targets, heartbeat_nodes=list(batch.nodes))


@admin.get(
    "/bring-up",
    response_model=BringUp,
    summary="Nodes on their way into service: their burn-in, and why any is stuck",
)
def read_bring_up(auth: Platform, session: DbSession) -> BringUp:
    return burnin.bring_up(session, utcnow())


@admin.get("/health", response_model=FleetHealth, summary="Fleet health: what is out and why")
def fleet_health(auth: Platform, session: DbSession) -> dict:
    return summary(session)


@admin.post(
    "/nodes/{node_id}/health",
    response_model=HealthActionOut,
    summary="Quarantine, release or retire a node by hand",
)
def node_health_action(
    node_id: str, body: HealthActionIn, auth: Platform, session: DbSession
) -> dict:
    node = get_or_404(session, Node, node_id, what="node", for_update=True)
    return act(session, node, None, body.action, body.reason)


@admin.post(
    "/gpus/{gpu_id}/health",
    response_model=HealthActionOut,
    summary="Quarantine, release or retire a GPU by hand",
)
def gpu_health_action(
    gpu_id: str, body: HealthActionIn, auth: Platform, session: DbSession
) -> dict:
    gpu = get_or_404(session, Gpu, gpu_id, what="gpu", for_update=True)
    node = get_or_404(session, Node, str(gpu.node_id), what="node", for_update=True)
    return act(session, node, gpu, body.action, body.reason)


@admin.get(
    "/nodes/{node_id}/health-events",
    response_model=HealthHistory,
    summary="A node's and its GPUs' health history, newest first",
)
def node_health_history(
    *,
    node_id: str,
    gpu_index: int | None = Query(None, ge=0, le=63, description="Only this GPU's"),
    limit: int = Query(100, ge=1, le=1000),
    auth: Platform,
    session: DbSession,
) -> dict:
    node = get_or_404(session, Node, node_id, what="node")
    return {"items": history(session, node, gpu_index, limit)}
