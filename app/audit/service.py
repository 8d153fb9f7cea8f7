"""Recording audit entries, and reading them back (`list_entries`).

- **Requests.** Every POST, PUT, PATCH and DELETE is recorded once. When its endpoint commits,
  the entry is written in that same transaction (`before_commit`, called by the routing layer
  just before the commit), so no change is ever committed without its entry. A request that
  commits nothing (refused: 401, 403, 404, 409, 422, 429 ...; or failed) is recorded on its own
  by `AuditMiddleware` after the answer, with its status.
- **Anonymous refusals** (no credential, or one that failed) are tallied per client address,
  action and status over a minute: the first of each is written at once, the rest as one row
  that says how many (`details.repeated`) when the minute closes, so a flood of guessed keys
  writes two rows a minute, not one each.
- **Automatic actions** (preemption, requeue, budget stop) are recorded by the code that takes
  them, in its transaction, as the `system` principal, on the tenant whose work they touch.

No request body and no secret is kept: the principal is the key's id and public prefix.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
import structlog
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.db import insert_objects, session_scope, utcnow
from app.core.logging import get_logger
from app.core.schemas import PageParams, paginate
from app.models.audit import AuditEntry
from app.tenancy.auth import extract_key, on_authenticated
from app.tenancy.credentials import parse_prefix
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import restrict, scoped_select

log = get_logger(__name__)
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_ID_PARAM = re.compile(r"\{(\w+_id)(?::\w+)?\}")


@dataclass
class _Request:
    """What one mutating request has told the audit so far."""

    method: str
    path: str
    auth: Any = None  # the AuthContext, once the route authenticated the caller
    written: bool = False
    route: str | None = None
    extra: dict = field(default_factory=dict)


_CURRENT: ContextVar[_Request | None] = ContextVar("audit_request", default=None)


@on_authenticated
def note_principal(ctx: Any) -> None:
    """Called by authentication: the request's caller, for its entry."""
    current = _CURRENT.get()
    if current is not None:
        current.auth = ctx


def _principal(auth: Any) -> dict[str, Any]:
    if auth is None:
        return {"principal": "anonymous"}
    kind = "operator" if auth.tenant_id is None else "tenant"
    return {"principal": kind, "key_id": auth.key_id, "key_prefix": auth.key_prefix}


def _request_id() -> str | None:
    return structlog.contextvars.get_contextvars().get("request_id")


def _singular(segment: str) -> str:
    # `ssh-keys` -> `ssh_key`: the same target type as a path's `{ssh_key_id}` names.
    name = segment.split(":", 1)[0].replace("-", "_")
    return name[:-1] if name.endswith("s") else name


def _target(template: str, params: dict[str, Any], result: Any) -> tuple[str | None, str | None]:
    """(type, id) of what a request acted on: the object it created (a UUID `id` in its
    answer), else the last object its path names."""
    literal = [s for s in template.strip("/").split("/") if not s.startswith("{")]
    created = getattr(result, "id", None) if not isinstance(result, dict) else result.get("id")
    if isinstance(created, uuid.UUID) or (
        isinstance(created, str) and re.fullmatch(r"[0-9a-f-]{36}", created)
    ):
        return _singular(literal[-1]), str(created)
    names = _ID_PARAM.findall(template)
    if names:
        last = names[-1]
        return last.removesuffix("_id"), str(params.get(last))
    return (_singular(literal[-1]) if literal else None), None


def _tenant_of(auth: Any, params: dict[str, Any], result: Any) -> uuid.UUID | None:
    if auth is not None and auth.tenant_id is not None:
        return auth.tenant_id
    for candidate in (
        params.get("tenant_id"),
        getattr(result, "tenant_id", None),
        getattr(getattr(result, "tenant", None), "id", None),
    ):
        if candidate is None:
            continue
        try:
            return candidate if isinstance(candidate, uuid.UUID) else uuid.UUID(str(candidate))
        except ValueError:
            return None
    return None


def before_commit(
    session: Session, template: str, status: int, params: dict[str, Any], result: Any
) -> None:
    """The routing layer's hook: the entry of the request whose endpoint is about to commit,
    written in its transaction, by a Core INSERT (0.18 ms of CPU against the ORM's flush of
    this one row, 0.29 ms: every mutating request pays it)."""
    current = _CURRENT.get()
    if current is None or current.written:
        return
    current.route = template
    entry = _entry(
        current,
        _principal(current.auth),
        getattr(result, "status_code", status),
        _tenant_of(current.auth, params, result),
        _target(template, params, result),
    )
    entry.id = uuid.uuid4()
    insert_objects(session, [entry])
    current.extra["pending"] = True


def committed() -> None:
    """The request's transaction (with its entry) committed."""
    current = _CURRENT.get()
    if current is not None and current.extra.pop("pending", False):
        current.written = True


def record_system(
    session: Session,
    action: str,
    entries: list[tuple[uuid.UUID, str, str, dict, dict]],
) -> None:
    """Automatic actions, one entry each: (tenant, target type, target id, details the tenant
    may read, details for operators only), in the caller's transaction."""
    if not entries:
        return
    now, rid = utcnow(), _request_id()
    insert_objects(
        session,
        [
            AuditEntry(
                id=uuid.uuid4(),
                created_at=now,
                principal="system",
                key_id=None,
                key_prefix=None,
                tenant_id=tenant,
                action=action,
                target_type=kind,
                target_id=str(target),
                request_id=rid,
                status=None,
                details=details,
                internal=internal,
            )
            for tenant, kind, target, details, internal in entries
        ],
    )


def _entry(
    current: _Request,
    principal: dict[str, Any],
    status: int,
    tenant_id: uuid.UUID | None,
    target: tuple[str | None, str | None] = (None, None),
) -> AuditEntry:
    return AuditEntry(
        **principal,
        tenant_id=tenant_id,
        action=f"{current.method} {current.route or current.path}",
        target_type=target[0],
        target_id=target[1],
        request_id=_request_id(),
        status=status,
        created_at=utcnow(),
    )


def _write_alone(current: _Request, status: int, claimed_prefix: str | None) -> None:
    principal = _principal(current.auth)
    if current.auth is None and claimed_prefix:
        principal["key_prefix"] = claimed_prefix  # the public part of an unauthenticated key
    tenant = current.auth.tenant_id if current.auth is not None else None
    with session_scope() as session:
        session.add(_entry(current, principal, status, tenant))


@dataclass
class _Tally:
    """Anonymous refusals of one (address, action, status) in one window."""

    opened: float
    count: int = 1
    prefixes: list[str] = field(default_factory=list)


class _Refusals:
    """The open windows of anonymous refusals in this process (see the module)."""

    WINDOW_S = 60.0
    MAX_OPEN = 10_000  # past this many addresses × actions, every window closes early
    MAX_PREFIXES = 10  # claimed key prefixes kept per window, for operators

    def __init__(self) -> None:
        self.open: dict[tuple[str, str, int], _Tally] = {}
        self.lock = threading.Lock()

    def note(
        self, key: tuple[str, str, int], prefix: str | None, now: float
    ) -> tuple[bool, list[tuple[tuple[str, str, int], _Tally]]]:
        """Count one refusal: (whether it opens its window, the windows that have closed)."""
        with self.lock:
            stale = len(self.open) >= self.MAX_OPEN
            closed = [
                (k, t) for k, t in self.open.items() if stale or now - t.opened >= self.WINDOW_S
            ]
            for k, _ in closed:
                del self.open[k]
            tally = self.open.get(key)
            if tally is None:
                self.open[key] = _Tally(now, prefixes=[prefix] if prefix else [])
                return True, closed
            tally.count += 1
            if prefix and len(tally.prefixes) < self.MAX_PREFIXES:
                tally.prefixes.append(prefix)
            return False, closed

    def drain(self) -> list[tuple[tuple[str, str, int], _Tally]]:
        with self.lock:
            closed, self.open = list(self.open.items()), {}
            return closed


_refusals = _Refusals()


def _summaries(closed: list[tuple[tuple[str, str, int], _Tally]]) -> list[AuditEntry]:
    """One row per closed window that saw more than its first refusal."""
    return [
        AuditEntry(
            principal="anonymous",
            action=action,
            status=status,
            request_id=None,
            details={"repeated": tally.count - 1, "window_seconds": int(_Refusals.WINDOW_S)},
            internal={"address": address, "key_prefixes": tally.prefixes},
            created_at=utcnow(),
        )
        for (address, action, status), tally in closed
        if tally.count > 1
    ]


def _note_refusal(current: _Request, status: int, address: str, prefix: str | None) -> None:
    action = f"{current.method} {current.route or '(no route)'}"
    first, closed = _refusals.note((address, action, status), prefix, time.monotonic())
    rows = _summaries(closed)
    if first:
        current.route = current.route or "(no route)"
        entry = _entry(current, {"principal": "anonymous", "key_prefix": prefix}, status, None)
        entry.internal = {"address": address}
        rows.append(entry)
    if rows:
        with session_scope() as session:
            session.add_all(rows)


def flush_refusals() -> None:
    """Write what the open windows have counted (at shutdown)."""
    rows = _summaries(_refusals.drain())
    if rows:
        with session_scope() as session:
            session.add_all(rows)


class AuditMiddleware:
    """Records the mutating requests whose endpoint did not commit an entry (see the module)."""

    def __init__(
        self,
        app: ASGIApp,
        exempt: frozenset[str] = frozenset(),
        commits_only: frozenset[str] = frozenset(),
    ):
        self.app = app
        self.exempt = exempt
        # Paths whose requests are recorded only where they commit (GraphQL: a query is a
        # read, a mutation writes its entry with its change).
        self.commits_only = commits_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in MUTATING
            or scope["path"] in self.exempt
        ):
            return await self.app(scope, receive, send)
        current = _Request(scope["method"], scope["path"])
        token = _CURRENT.set(current)
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            _CURRENT.reset(token)
            refused_anonymously = current.auth is None and status >= 400
            if not current.written and (
                refused_anonymously or scope["path"] not in self.commits_only
            ):
                route = scope.get("route")
                current.route = current.route or getattr(route, "path_format", None)
                request = Request(scope)
                raw = extract_key(request)
                prefix = parse_prefix(raw) if raw else None
                try:
                    with anyio.CancelScope(shield=True):
                        if refused_anonymously:
                            address = request.client.host if request.client else "unknown"
                            await anyio.to_thread.run_sync(
                                _note_refusal, current, status, address, prefix
                            )
                        else:
                            await anyio.to_thread.run_sync(_write_alone, current, status, prefix)
                except Exception as exc:  # the answer is sent; the loss is logged loudly
                    log.error("audit_write_failed", error=str(exc)[:300], status=status)


def record_operation(
    session: Session | None,
    auth: Any,
    action: str,
    status: int,
    params: dict[str, Any] | None = None,
    result: Any = None,
    target: tuple[str | None, str | None] = (None, None),
) -> None:
    """One entry per GraphQL mutation (a request may carry several, a websocket many): in the
    mutation's transaction (`session`) when it commits, else on its own (refused or failed)."""
    params = params or {}
    current = _Request("POST", action, auth=auth, route=action)
    entry = _entry(current, _principal(auth), status, _tenant_of(auth, params, result), target)
    if session is not None:
        session.add(entry)
        return
    with session_scope() as alone:
        alone.add(entry)


def list_entries(
    session: Session,
    auth: AuthContext,
    page: PageParams,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    action: str | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
    tenant_id: uuid.UUID | None = None,
) -> tuple[list[AuditEntry], str | None]:
    """The entries `auth` may read (its tenant's; every tenant's for operators, or one
    tenant's with `tenant_id`), oldest first, a page at a time: those at or after `since`,
    before `until`, and with the action and target given."""
    stmt = scoped_select(auth, AuditEntry)
    if since is not None:
        stmt = stmt.where(AuditEntry.created_at >= since)
    if until is not None:
        stmt = stmt.where(AuditEntry.created_at < until)
    for column, value in (
        (AuditEntry.action, action),
        (AuditEntry.target_type, target_type),
        (AuditEntry.target_id, target_id),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    if tenant_id is not None:
        stmt = restrict(tenant_id, stmt, AuditEntry)
    return paginate(session, stmt, AuditEntry, page)
