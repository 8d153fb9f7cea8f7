"""Workload credentials: what a running workload reports its own progress and checkpoints with.

A node agent hands each run `RACKPLANE_TOKEN`; it speaks for that workload's current run only
(`rpw_<workload id>.<attempt>.<mac>`), and nothing else: not another workload, not the tenant's
other routes. It is derived (an HMAC under the server's pepper), so nothing is stored, and it
stops working when the workload is placed again (a new attempt) or ends."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import uuid
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from app.core.db import as_aware, session_scope, utcnow
from app.core.errors import Unauthorized
from app.core.secrets import server_secret
from app.models.tenants import Tenant
from app.models.workloads import Workload
from app.ratelimit import service as ratelimit
from app.tenancy.auth import authenticate, charge_anonymous
from app.tenancy.principal import AuthContext, require_tenant_scope

PREFIX = "rpw_"
SCOPE = "workload"  # implies no other scope: a token passes no tenant_* check
_SHAPE = re.compile(r"^rpw_([0-9a-f]{32})\.(\d{1,9})\.([A-Za-z0-9_-]{32})$")
_ENDED = frozenset({"succeeded", "failed", "terminated"})
# How long a run may outlive its workload's terminate: its node's agent sends SIGTERM, then
# SIGKILL after this grace (app/agents/runs.py gives running work this grace). Its token, and a
# checkpoint it writes meanwhile, count until then (with a few seconds for the report's trip).
STOP_GRACE_S = 30.0
_REPORT_SLACK_S = 5.0


def in_stop_grace(state: str, finished_at: datetime | None, now: datetime) -> bool:
    """Whether a workload terminated so recently that its run may still be in its grace."""
    if state != "terminated" or finished_at is None:
        return False
    return (now - as_aware(finished_at)).total_seconds() <= STOP_GRACE_S + _REPORT_SLACK_S


_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="WorkloadToken",
    description="A run's own credential (`RACKPLANE_TOKEN`, `rpw_...`) or a tenant API key",
)


def _mac(body: str) -> str:
    digest = hmac.new(
        server_secret("key_pepper"), b"workload-token:" + body.encode(), hashlib.sha256
    ).digest()
    return base64.urlsafe_b64encode(digest[:24]).decode()


def mint(workload_id: uuid.UUID, attempt: int) -> str:
    body = f"{workload_id.hex}.{attempt}"
    return f"{PREFIX}{body}.{_mac(body)}"


def parse(raw: str) -> tuple[uuid.UUID, int] | None:
    """(workload id, attempt) of a genuine token, else None."""
    m = _SHAPE.match(raw)
    if m is None:
        return None
    body = f"{m.group(1)}.{m.group(2)}"
    if not hmac.compare_digest(_mac(body), m.group(3)):
        return None
    return uuid.UUID(m.group(1)), int(m.group(2))


def _context_of(workload_id: uuid.UUID, attempt: int) -> AuthContext | None:
    with session_scope() as session:
        row = session.execute(
            select(
                Workload.tenant_id,
                Workload.attempts,
                Workload.state,
                Workload.finished_at,
                Tenant.status,
            )
            .join(Tenant, Tenant.id == Workload.tenant_id)
            .where(Workload.id == workload_id)
        ).first()
    if row is None or row.attempts != attempt:
        return None
    if row.state in _ENDED and not in_stop_grace(row.state, row.finished_at, utcnow()):
        return None
    return AuthContext(
        key_id=workload_id,
        key_prefix="workload",
        tenant_id=row.tenant_id,
        scopes=frozenset({SCOPE}),
        tenant_status=row.status,
    )


async def workload_writer(
    request: Request,
    workload_id: str,
    bearer: HTTPAuthorizationCredentials | None = Depends(_bearer),
) -> AuthContext:
    """A route that reports on one workload (`{workload_id}` in its path): its own run's token,
    or a tenant key with the `write` scope. A token of another workload, or of an earlier run
    of this one, is refused (401) before the workload is looked at."""
    raw = bearer.credentials if bearer is not None else ""
    if not raw.startswith(PREFIX):
        auth = await authenticate(request)
        require_tenant_scope(auth, "write")
        return auth
    parsed = parse(raw)
    ctx = None
    if parsed is not None and workload_id.replace("-", "").lower() == parsed[0].hex:
        ctx = await run_in_threadpool(_context_of, *parsed)
    if ctx is None:
        charge_anonymous(request)
        raise Unauthorized(
            "This workload token is not valid for this workload's current run (another "
            "workload's, an earlier run's, or the workload has ended).",
            code="invalid_workload_token",
        )
    if ctx.tenant_status != "active":
        require_tenant_scope(ctx, SCOPE)  # the same refusal a tenant key would get
    route = request.scope.get("route")
    await ratelimit.check_async(
        request.scope,
        ratelimit.route_class(request.method, getattr(route, "path_format", request.url.path)),
        key=str(ctx.key_id),
        tenant=str(ctx.tenant_id),
        operator=False,
    )
    return ctx


WorkloadWriter = Annotated[AuthContext, Depends(workload_writer)]
