"""`Idempotency-Key` for POST, PATCH and DELETE: the same key and request replay the first
response; the same key with another request is a 409.

- **Authenticated first.** The key is checked before anything is claimed or replayed, and a
  stored response is handed back only by the route itself, after its own authentication and
  scope checks have passed (`app.core.routing.REPLAY`). A malformed, unknown, revoked or expired
  key gets no idempotency at all: the route answers 401 as it would without the header.
- **Claimed per account, replayed per key**: a tenant's keys share one namespace, as Stripe's
  account does (the same Idempotency-Key sent with two keys of one tenant is one request, run
  once), operators share another. The stored answer is handed back only to the key that made
  the request, and only while its standing (tenant status) is what it was then: any other key
  gets 409 `idempotency_key_reused`, never the answer. An answer may carry a secret (a new API
  key) that the other key's own scopes would never let it see.
- **Anonymous requests** (signup) are keyed by their content, and their replays never carry
  a secret: nothing proves that the caller replaying a signup is the one who sent it (the body
  and an Idempotency-Key are no credential; keys turn up in logs and proxies), so the API key
  a signup created is shown only in the first response. The replay says what was created.
- **No secret at rest**: stored bodies are sealed with AES-GCM under a server secret, bound to
  their namespace and key, so a database dump holds no usable API key.
- **Applied is known in the request's own transaction**: the endpoint's commit marks the record
  applied (`before_commit`). If its answer is then lost (a failover during COMMIT, a failure
  after it), the record stays, and a retry with the key gets 409 `idempotency_answer_lost`: the
  request is never applied twice. A request that failed before its commit is forgotten and may
  be sent again with the same key.
- **Canonical requests**: JSON bodies are compared by content (key order and whitespace do not
  matter), content types by media type (parameters such as `charset` do not matter).
"""

from __future__ import annotations

import hashlib
import json
from contextvars import ContextVar
from datetime import timedelta

import anyio
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.config import get_settings
from app.core.db import get_sessionmaker, utcnow
from app.core.errors import AppError
from app.core.middleware import replay_body, send_problem
from app.core.routing import REPLAY
from app.core.secrets import seal, unseal
from app.models.idempotency import IdempotencyRecord
from app.tenancy.auth import AUTH_STATE, context_of, credential_of
from app.tenancy.credentials import parse_prefix
from app.tenancy.nodes import is_node_secret
from app.tenancy.principal import AuthContext

# A first request still marked in flight after this long is presumed dead; its key may be reused.
IN_FLIGHT_TIMEOUT = timedelta(seconds=60)
METHODS = frozenset({"POST", "PATCH", "DELETE"})
_REPLAYED_HEADERS = {b"content-type", b"location"}
_PURPOSE = "idempotency"


def media_type(raw: bytes) -> bytes:
    """`Application/JSON; charset=utf-8` -> `application/json`."""
    return raw.split(b";", 1)[0].strip().lower()


def canonical_body(content_type: bytes, body: bytes) -> bytes:
    """The body as compared: JSON by content, anything else byte for byte."""
    if body and (content_type.endswith(b"/json") or content_type.endswith(b"+json")):
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return body
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return body


def request_hash(scope: Scope, body: bytes) -> str:
    ctype = media_type(dict(scope["headers"]).get(b"content-type", b""))
    h = hashlib.sha256()
    for part in (
        scope["method"].encode(),
        scope["path"].encode(),
        scope.get("query_string", b""),
        ctype,
        canonical_body(ctype, body),
    ):
        h.update(part + b"\x00")
    return h.hexdigest()


def namespace(ctx: AuthContext | None, req_hash: str) -> str:
    """Whose records these are: the API key's (a portal session's, its key's), or (anonymous)
    this content's. Per key, not per account: a read key could otherwise claim a predictable
    Idempotency-Key and block it for the account's other keys for a day."""
    if ctx is None:
        return f"anon:{req_hash[:32]}"
    return f"key:{ctx.key_id}"


def withhold_secrets(body: bytes) -> bytes:
    """The body with every API key, join token and node credential in it replaced by null
    (what anonymous replays get: an agent's join answers with its node's credential)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str) and (parse_prefix(v) is not None or is_node_secret(v)):
            return None
        return v

    return json.dumps(walk(value)).encode()


def owner_of(ctx: AuthContext) -> str:
    """Who a stored answer belongs to: the key (whose scopes never change) and its tenant's
    status. A replay needs both unchanged, so it is authorized exactly as the first request
    was; a GraphQL replay has no route of its own to re-check it."""
    return f"{ctx.key_id}:{ctx.tenant_status or 'platform'}"


def _context(principal: str, key: str) -> bytes:
    return f"{principal}\x00{key}".encode()


def _claim(principal: str, key: str, req_hash: str, owner: str | None):
    """Insert the in-flight record, or return what stands in the way: ('replay', stored),
    ('mismatch', None), ('not_yours', None), ('in_flight', None). Returns ('claimed', None) on
    success."""
    ttl = timedelta(hours=get_settings().idempotency_ttl_hours)
    with get_sessionmaker()() as s:
        now = utcnow()
        for _ in range(3):
            try:
                s.add(
                    IdempotencyRecord(
                        principal=principal,
                        key=key,
                        request_hash=req_hash,
                        owner=owner,
                        created_at=now,
                    )
                )
                s.commit()
                return "claimed", None
            except IntegrityError:
                s.rollback()
            rec = s.scalar(
                select(IdempotencyRecord).where(
                    IdempotencyRecord.principal == principal, IdempotencyRecord.key == key
                )
            )
            if rec is None:
                continue
            created = (
                rec.created_at
                if rec.created_at.tzinfo
                else rec.created_at.replace(tzinfo=now.tzinfo)
            )
            # Applied, its answer never stored: told once the first request is done with it
            # (it said so, or it has been in flight too long), never run again.
            lost = rec.applied_at is not None and rec.status_code is None
            kept = rec.completed_at is not None or rec.applied_at is not None
            stale = (kept and now - created > ttl) or (
                not kept and now - created > IN_FLIGHT_TIMEOUT
            )
            body = None
            if rec.completed_at is not None and not lost:
                body = unseal(_PURPOSE, rec.response_body or b"", _context(principal, key))
                stale = stale or body is None  # sealed under a secret since replaced: forgotten
            if stale:
                s.execute(delete(IdempotencyRecord).where(IdempotencyRecord.id == rec.id))
                s.commit()
                continue
            if rec.request_hash != req_hash:
                return "mismatch", None
            if owner is not None and rec.owner != owner:
                return "not_yours", None
            if lost and (rec.completed_at is not None or now - created > IN_FLIGHT_TIMEOUT):
                return "answer_lost", None
            if rec.completed_at is None:
                return "in_flight", None
            return "replay", (rec.status_code, rec.response_headers or {}, body)
        return "in_flight", None


def _finish(principal: str, key: str, status: int, headers: dict, body: bytes) -> None:
    with get_sessionmaker()() as s:
        cond = (IdempotencyRecord.principal == principal, IdempotencyRecord.key == key)
        if 200 <= status < 300:
            if principal.startswith("anon:"):
                body = withhold_secrets(body)
            s.execute(
                update(IdempotencyRecord)
                .where(*cond)
                .values(
                    status_code=status,
                    response_headers=headers,
                    response_body=seal(_PURPOSE, body, _context(principal, key)),
                    completed_at=utcnow(),
                )
            )
        else:  # failures are not remembered: the client may fix the request and retry with the key
            # ...unless the request's transaction did commit (its answer failed after, or the
            # connection went during COMMIT): then the record stays, and a retry is not run.
            applied = IdempotencyRecord.applied_at.is_not(None)
            s.execute(
                delete(IdempotencyRecord).where(*cond, IdempotencyRecord.applied_at.is_(None))
            )
            s.execute(update(IdempotencyRecord).where(*cond, applied).values(completed_at=utcnow()))
        s.commit()


# The claim of the request being handled: its endpoint's transaction marks it applied.
CLAIMED: ContextVar[tuple[str, str] | None] = ContextVar("idempotency_claim", default=None)


def before_commit(session: Session, template: str, status: int, params: dict, result) -> None:
    """The routing layer's hook (app/core/routing.py): the claimed record is marked applied in
    the transaction that applies the request, so whether it landed is never in doubt."""
    claim = CLAIMED.get()
    if claim is not None:
        principal, key = claim
        session.execute(
            update(IdempotencyRecord)
            .where(IdempotencyRecord.principal == principal, IdempotencyRecord.key == key)
            .values(applied_at=utcnow())
        )


# A portal sign-in's answer is a cookie: never stored, never replayed (each is its own session).
EXEMPT = frozenset({"/v1/sessions", "/v1/sessions/current"})


# The answers to a claim that cannot run the request (`_claim`'s outcomes): status, code,
# title, detail, headers.
_REFUSALS: dict[str, tuple[int, str, str, str, list]] = {
    "not_yours": (
        409,
        "idempotency_key_reused",
        "Idempotency-Key reused",
        "This Idempotency-Key was already used by another API key of this account (or before "
        "the account's status changed); its answer goes only to the key that sent it. Use a new "
        "Idempotency-Key.",
        [],
    ),
    "mismatch": (
        409,
        "idempotency_key_reused",
        "Idempotency-Key reused",
        "This Idempotency-Key was already used with a different request body or path.",
        [],
    ),
    "answer_lost": (
        409,
        "idempotency_answer_lost",
        "Request applied, answer lost",
        "The request with this Idempotency-Key was applied, but its answer was lost when a "
        "backing service failed over; it is not applied again. Read what it changed (for "
        "example, list the resources it creates).",
        [],
    ),
    "in_flight": (
        409,
        "idempotency_request_in_progress",
        "Request in progress",
        "A request with this Idempotency-Key is still being processed; retry shortly.",
        [(b"retry-after", b"1")],
    ),
}


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client went away first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


class IdempotencyMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in METHODS or scope["path"] in EXEMPT:
            return await self.app(scope, receive, send)
        key_raw = dict(scope["headers"]).get(b"idempotency-key")
        if key_raw is None:
            return await self.app(scope, receive, send)
        key = key_raw.decode("latin-1").strip()
        if not 1 <= len(key) <= 255 or not key.isprintable():
            return await send_problem(
                send,
                400,
                "invalid_idempotency_key",
                "Invalid Idempotency-Key",
                "Idempotency-Key must be 1 to 255 printable characters.",
                instance=scope["path"],
            )
        ctx: AuthContext | None = None
        request = Request(scope)
        if credential_of(request) is not None:
            try:
                ctx = await context_of(request)
            except AppError:  # not a live key: the route answers 401, nothing is claimed
                return await self.app(scope, receive, send)
            scope.setdefault("state", {})[AUTH_STATE] = ctx
        body = await _read_body(receive)
        if body is None:
            return
        req_hash = request_hash(scope, body)
        principal = namespace(ctx, req_hash)
        owner = owner_of(ctx) if ctx is not None else None
        outcome, rec = await anyio.to_thread.run_sync(_claim, principal, key, req_hash, owner)
        if outcome in _REFUSALS:
            status, code, title, detail, headers = _REFUSALS[outcome]
            return await send_problem(
                send, status, code, title, detail, headers=headers or None, instance=scope["path"]
            )
        if outcome == "replay":  # the route hands it back once its own checks have passed
            token = REPLAY.set(rec)
            try:
                return await self.app(scope, replay_body(body, receive), send)
            finally:
                REPLAY.reset(token)
        await self._run_and_keep(scope, receive, send, body, principal, key)

    async def _run_and_keep(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, principal, key: str
    ) -> None:
        """Run the request it claimed, and keep its answer for the key's replays (a 500 when it
        failed outright)."""
        status = 500
        resp_headers: dict[str, str] = {}
        resp_body = bytearray()

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                for k, v in message.get("headers", []):
                    if k.lower() in _REPLAYED_HEADERS:
                        resp_headers[k.decode("latin-1").lower()] = v.decode("latin-1")
            elif message["type"] == "http.response.body":
                resp_body.extend(message.get("body", b""))
            await send(message)

        token = CLAIMED.set((principal, key))
        try:
            await self.app(scope, replay_body(body, receive), capture)
        except BaseException:
            await anyio.to_thread.run_sync(_finish, principal, key, 500, {}, b"")
            raise
        finally:
            CLAIMED.reset(token)
        await anyio.to_thread.run_sync(
            _finish, principal, key, status, resp_headers, bytes(resp_body)
        )
