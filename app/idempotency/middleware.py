"""`Idempotency-Key` for POST: the same key and body replay the first response; the same key
with another body is a 409. Records are per API key and kept for a configured time."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import anyio
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.config import get_settings
from app.core.db import get_sessionmaker, utcnow
from app.core.middleware import replay_body, send_problem
from app.idempotency.models import IdempotencyRecord
from app.tenancy.auth import parse_prefix

# A first request still marked in flight after this long is presumed dead; its key may be reused.
IN_FLIGHT_TIMEOUT = timedelta(seconds=60)
_REPLAYED_HEADERS = {b"content-type", b"location"}


def _principal(scope: Scope, body_hash: str) -> str:
    headers = dict(scope["headers"])
    raw = headers.get(b"authorization", b"").decode("latin-1")
    key = (
        raw.partition(" ")[2].strip()
        if raw.lower().startswith("bearer ")
        else headers.get(b"x-api-key", b"").decode("latin-1")
    )
    prefix = parse_prefix(key) if key else None
    # Anonymous requests (signup) are keyed by their content, so nobody can replay another's.
    return f"key:{prefix}" if prefix else f"anon:{body_hash[:32]}"


def _claim(principal: str, key: str, req_hash: str):
    """Insert the in-flight record, or return what stands in the way: ('replay', rec),
    ('mismatch', None), ('in_flight', None). Returns ('claimed', None) on success."""
    ttl = timedelta(hours=get_settings().idempotency_ttl_hours)
    with get_sessionmaker()() as s:
        now = utcnow()
        for _ in range(3):
            try:
                s.add(
                    IdempotencyRecord(
                        principal=principal, key=key, request_hash=req_hash, created_at=now
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
            stale = (rec.completed_at is not None and now - created > ttl) or (
                rec.completed_at is None and now - created > IN_FLIGHT_TIMEOUT
            )
            if stale:
                s.execute(delete(IdempotencyRecord).where(IdempotencyRecord.id == rec.id))
                s.commit()
                continue
            if rec.request_hash != req_hash:
                return "mismatch", None
            if rec.completed_at is None:
                return "in_flight", None
            return "replay", (rec.status_code, rec.response_headers, rec.response_body)
        return "in_flight", None


def _finish(principal: str, key: str, status: int, headers: dict, body: bytes) -> None:
    with get_sessionmaker()() as s:
        cond = (IdempotencyRecord.principal == principal, IdempotencyRecord.key == key)
        if 200 <= status < 300:
            s.execute(
                update(IdempotencyRecord)
                .where(*cond)
                .values(
                    status_code=status,
                    response_headers=headers,
                    response_body=body,
                    completed_at=utcnow(),
                )
            )
        else:  # failures are not remembered: the client may fix the request and retry with the key
            s.execute(delete(IdempotencyRecord).where(*cond))
        s.commit()


class IdempotencyMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        key_raw = dict(scope["headers"]).get(b"idempotency-key")
        if key_raw is None:
            return await self.app(scope, receive, send)
        key = key_raw.decode("latin-1").strip()
        if not 1 <= len(key) <= 255:
            return await send_problem(
                send,
                400,
                "invalid_idempotency_key",
                "Invalid Idempotency-Key",
                "Idempotency-Key must be 1 to 255 characters.",
            )
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        h = hashlib.sha256()
        for part in (
            scope["method"].encode(),
            scope["path"].encode(),
            scope.get("query_string", b""),
            dict(scope["headers"]).get(b"content-type", b""),
            body,
        ):
            h.update(part + b"\x00")
        req_hash = h.hexdigest()
        principal = _principal(scope, req_hash)
        outcome, rec = await anyio.to_thread.run_sync(_claim, principal, key, req_hash)
        if outcome == "mismatch":
            return await send_problem(
                send,
                409,
                "idempotency_key_reused",
                "Idempotency-Key reused",
                "This Idempotency-Key was already used with a different request body or path.",
            )
        if outcome == "in_flight":
            return await send_problem(
                send,
                409,
                "idempotency_request_in_progress",
                "Request in progress",
                "A request with this Idempotency-Key is still being processed; retry shortly.",
                headers=[(b"retry-after", b"1")],
            )
        if outcome == "replay":
            status, headers, rbody = rec
            hdrs = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        *hdrs,
                        (b"content-length", str(len(rbody or b"")).encode()),
                        (b"idempotent-replayed", b"true"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": rbody or b""})
            return

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

        try:
            await self.app(scope, replay_body(body, receive), capture)
        except BaseException:
            await anyio.to_thread.run_sync(_finish, principal, key, 500, {}, b"")
            raise
        await anyio.to_thread.run_sync(
            _finish, principal, key, status, resp_headers, bytes(resp_body)
        )
