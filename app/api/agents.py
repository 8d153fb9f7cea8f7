"""The node agent's routes (`/v1/agent`, by node credential) and the operator's side of joining
(`/v1/admin/nodes/{id}/join-tokens`, `.../credentials:revoke`)."""

from __future__ import annotations

import re
import time
import uuid

from fastapi import Path, Query, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.agents import inventory, runs, service
from app.agents.schemas import (
    CredentialsRevoked,
    Joined,
    JoinIn,
    JoinTokenCreate,
    JoinTokenOut,
    NodeIdentity,
)
from app.api.health import EXPOSITION_PATTERN, PROMETHEUS_TYPES
from app.core import pubsub
from app.core.batching import GroupCommit
from app.core.config import get_settings
from app.core.db import get_or_404, session_scope, utcnow
from app.core.errors import PayloadTooLarge, ValidationFailed
from app.core.logging import get_logger
from app.core.middleware import RELEASE_SLOT
from app.core.routing import DbSession, api_router
from app.health import burnin, telemetry
from app.health.schemas import TelemetryResult
from app.models.fleet import Node
from app.scheduling.lifecycle import agent_topic
from app.tenancy.auth import Platform, charge_anonymous
from app.tenancy.nodes import NodeAgent, NodeCaller
from rackplane_wire import (
    Assignments,
    BurnInReport,
    Inventory,
    InventoryVerdict,
    RunEnv,
    StatusAck,
    StatusReport,
)

log = get_logger(__name__)
router = api_router(prefix="/v1/agent", tags=["agent"])
admin = api_router(prefix="/v1/admin", tags=["admin: fleet"])


@admin.post(
    "/nodes/{node_id}/join-tokens",
    status_code=201,
    response_model=JoinTokenOut,
    summary="Make a single-use join token for a node's agent (shown once)",
)
def create_join_token(
    node_id: str, auth: Platform, session: DbSession, body: JoinTokenCreate | None = None
) -> JoinTokenOut:
    node = get_or_404(session, Node, node_id, what="node")
    body = body or JoinTokenCreate()
    return service.create_join_token(session, node, body.ttl_s, body.adopt)


@admin.post(
    "/nodes/{node_id}/credentials:revoke",
    response_model=CredentialsRevoked,
    summary="Revoke a node's agent credentials (its running work is left alone)",
)
def revoke_credentials(node_id: str, auth: Platform, session: DbSession) -> CredentialsRevoked:
    return service.revoke_all(session, get_or_404(session, Node, node_id, what="node"))


@router.post(
    "/join",
    status_code=201,
    response_model=Joined,
    summary="Trade a join token for the node's credential (once per token)",
)
def join(body: JoinIn, request: Request, session: DbSession) -> Joined:
    charge_anonymous(request)  # no credential yet: the caller's address pays, as anonymous
    return service.join(session, body.token)


@router.get("/node", response_model=NodeIdentity, summary="The node this credential speaks for")
def node(caller: NodeAgent, session: DbSession) -> NodeIdentity:
    return service.identity(session, caller)


@router.post(
    "/credentials:rotate",
    status_code=201,
    response_model=Joined,
    summary="A new credential for this node; the one presented stops working",
)
def rotate(caller: NodeAgent, session: DbSession) -> Joined:
    return service.rotate(session, caller)


@router.put(
    "/inventory",
    response_model=InventoryVerdict,
    summary="What the host has (GPUs, MIG instances, driver): compared with the fleet's record",
    description=(
        "A difference (a GPU missing, another model, another MIG mode, a replaced GPU's UUID) "
        "puts a ready node in `validating`, named in its state reason, and it takes no new "
        "work; an inventory that matches again returns it to `ready`. A GPU UUID the fleet "
        "records on another node's GPU is such a difference, named with that node, and is "
        "never moved. Assignments name devices by the UUIDs of the latest inventory."
    ),
)
def put_inventory(body: Inventory, caller: NodeAgent, session: DbSession) -> InventoryVerdict:
    return inventory.report(session, caller, body)


_WAIT = re.compile(r"^(\d{1,6}(?:\.\d{1,3})?)(ms|s|m)?$")
# Without a wake-up (PostgreSQL without Redis), a waiting agent's index is read again this often.
_RECHECK_S = 5.0
# Each node's last answer, kept until its agent topic is published: a poll that finds nothing
# new, and a wait that times out, cost no database read. The TTL bounds what a lost message
# (a publish that failed) could leave.
_answers = pubsub.TopicCache(ttl_s=120.0)


def _seconds(wait: str) -> float:
    m = _WAIT.match(wait)
    if m is None:
        raise ValidationFailed(
            "wait is a duration such as 30s, 500ms or 1m.", code="invalid_wait", field="wait"
        )
    value = float(m.group(1))
    return {"ms": value / 1000, "m": value * 60}.get(m.group(2) or "s", value)


def _read(caller: NodeCaller, topic: str, index: int) -> Assignments | None:
    token = _answers.begin(topic)
    with session_scope() as session:
        # Where nothing can be cached, a poll that finds nothing newer reads only the index.
        if token is None and index >= 0 and runs.index_of(session, caller.node_id) <= index:
            return None
        out = runs.assignments(session, caller)
    _answers.put(topic, token, out)
    return out


async def _newer(caller: NodeCaller, topic: str, index: int) -> Assignments | None:
    """The node's desired state if newer than `index` (-1: whatever it is), from the cache or
    read in the thread pool (and cached)."""
    out = _answers.get(topic)
    if out is None:
        out = await run_in_threadpool(_read, caller, topic, index)
    else:
        out = runs.refreshed(out)
    return out if out is not None and out.index > index else None


@router.get(
    "/assignments",
    response_model=Assignments,
    summary="The node's desired state: a blocking query on its index",
    description=(
        "Answers at once when the node's desired state is newer than `index` (0: always), "
        "otherwise when it changes, otherwise after `wait` (at most a minute) with the same "
        "index. The answer is the whole desired state, never a difference: every run the node "
        "should have, to start or to stop; the agent stops anything else it runs."
    ),
)
async def get_assignments(
    request: Request,
    caller: NodeAgent,
    index: int = Query(0, ge=0, le=2**62, description="The index of the last answer"),
    wait: str = Query(
        "30s",
        max_length=16,
        pattern=_WAIT.pattern,
        description="How long to wait for a change: `30s`, `500ms`, `1m`",
    ),
) -> Assignments:
    seconds = min(_seconds(wait), get_settings().agent_max_wait_seconds)
    deadline = time.monotonic() + seconds
    topic = agent_topic(caller.node_name)
    waiter = pubsub.hub.register_topic(topic)
    try:
        while True:
            waiter.clear()  # before the read: a change committed after it wakes us
            # The server stopping: the current state now (the agent asks again, of whichever
            # server answers).
            left = 0.0 if pubsub.hub.closing else deadline - time.monotonic()
            out = await _newer(caller, topic, index if left > 0 else -1)
            if out is not None:
                return out
            # Waiting holds no connection: give the request's in-flight slot back, or a
            # thousand waiting agents would starve every other request.
            request.scope.get("state", {}).get(RELEASE_SLOT, lambda: None)()
            await waiter.wait(min(left, _RECHECK_S))
    finally:
        pubsub.hub.unregister(waiter)


@router.get(
    "/runs/{workload_id}/{attempt}/{replica}/env",
    response_model=RunEnv,
    summary="The secret part of a run's environment, for the node about to start it",
    description=(
        "The workload's own `env` and the run's `RACKPLANE_TOKEN`, which the node's desired "
        "state does not carry (`fetch_env`). Answered only while this node holds that run "
        "(that workload's replica, at that attempt) and it has not reported it started; "
        "otherwise 409 `run_not_startable`."
    ),
)
def get_run_env(
    workload_id: uuid.UUID,
    caller: NodeAgent,
    session: DbSession,
    attempt: int = Path(ge=0, le=2**31 - 1),
    replica: int = Path(ge=0, le=100_000),
) -> RunEnv:
    return runs.run_env(session, caller, workload_id, attempt, replica)


@router.post(
    "/status",
    response_model=StatusAck,
    summary="The state of the node's runs (batched); also its heartbeat",
    description=(
        "Each run's current state: running (with its pid), exited (code or signal, whether "
        "the control plane had asked it to stop, the last lines of output), failed to start, "
        "or lost. A report that repeats what is recorded changes nothing; one about a run the "
        "control plane no longer holds (another attempt, another node) is counted as stale. "
        "Every replica running starts the workload's run; an exit ends its usage at the exit: "
        "0 from every replica is a success, anything else from any replica a failure."
    ),
)
async def post_status(body: StatusReport, request: Request, caller: NodeAgent) -> StatusAck:
    burn = body.burn_in if body.burn_in is not None and body.burn_in.done else None
    if burn is None:
        return await run_in_threadpool(_report, caller, body)
    ack = StatusAck(accepted=0, stale=0)
    if body.runs or body.inventory is not None or body.mig_layouts:  # its inventory first
        ack = await run_in_threadpool(_report, caller, body.model_copy(update={"burn_in": None}))
    # A finished burn-in is judged with every other one that arrives meanwhile: one
    # transaction moves them all (one bump of their region's fleet version, one placement
    # kick), not one each queued on the region's row. Waiting for it holds no in-flight slot
    # (as a long poll's wait does not), so heartbeats and assignments never queue behind a
    # fleet's bring-up. The report is its node's heartbeat there, after the judgement.
    request.scope.get("state", {}).get(RELEASE_SLOT, lambda: None)()
    await _burn_ins.submit((caller, burn))
    return ack


def _report(caller: NodeCaller, body: StatusReport) -> StatusAck:
    with session_scope() as session:
        return runs.report(session, caller, body)


def _take(session: Session, reports: list[tuple[NodeCaller, BurnInReport]]) -> list[bool]:
    out = burnin.take_many(session, [(c.node_id, report) for c, report in reports], utcnow())
    telemetry.ingest(session, [], {}, heartbeat_nodes=sorted({c.node_name for c, _ in reports}))
    return out


def _judge(reports: list[tuple[NodeCaller, BurnInReport]]) -> list[bool | BaseException]:
    """Judge finished burn-ins in one transaction (their nodes locked in id order); if it
    fails, each in its own, so a report that cannot be taken fails only its own request."""
    order = sorted(range(len(reports)), key=lambda i: reports[i][0].node_id)
    try:
        with session_scope() as session:
            taken = _take(session, [reports[i] for i in order])
        out = dict(zip(order, taken, strict=True))
        return [out[i] for i in range(len(reports))]
    except Exception:
        if len(reports) == 1:
            raise
        log.warning("burn_in_batch_failed", reports=len(reports), exc_info=True)
    results: list[bool | BaseException] = []
    for item in reports:
        try:
            with session_scope() as session:
                results.append(_take(session, [item])[0])
        except Exception as exc:
            results.append(exc)
    return results


_burn_ins: GroupCommit[tuple[NodeCaller, BurnInReport], bool] = GroupCommit(_judge)


# What an agent pushes: dcgm-exporter's text as it is (or NVML samples in the same form).
_TELEMETRY_BODY = {
    "requestBody": {
        "required": True,
        "description": "Prometheus text, as dcgm-exporter serves it, about this node's GPUs.",
        "content": {"text/plain": {"schema": {"type": "string", "pattern": EXPOSITION_PATTERN}}},
    }
}


@router.post(
    "/telemetry",
    response_model=TelemetryResult,
    openapi_extra=_TELEMETRY_BODY,
    summary="Push this node's GPU telemetry (dcgm-exporter's text, as it is)",
    description=(
        "What the operator's `POST /v1/admin/telemetry` takes, for one node: samples labelled "
        "with another node's hostname are rejected (`bad_label`), and a GPU named by UUID "
        "alone is read as this node's. Also the node's heartbeat."
    ),
)
async def push_telemetry(request: Request, caller: NodeAgent) -> dict:
    raw = await request.body()
    limit = get_settings().max_agent_telemetry_bytes
    if len(raw) > limit:
        raise PayloadTooLarge(f"A node's telemetry pushes are limited to {limit} bytes.")
    ctype = request.headers.get("content-type", "text/plain").split(";")[0].strip().lower()
    if ctype not in PROMETHEUS_TYPES:
        raise ValidationFailed(
            f"Content-Type {ctype} is not one this endpoint reads: send text/plain "
            "(Prometheus text exposition).",
            code="unsupported_media_type",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationFailed("Telemetry must be UTF-8 text.", code="malformed_sample") from None
    return await run_in_threadpool(_ingest, text, caller.node_name)


def _ingest(text: str, node: str) -> dict:
    with session_scope() as session:
        return telemetry.ingest_from_node(session, text, node).reply()
