"""The per-request context: who is calling (the same AuthContext as REST), the request's
database session, and loaders built for this request (bound to the caller, so a loader can never
return another tenant's row)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import strawberry
from fastapi import Depends
from graphql import GraphQLError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection
from strawberry.fastapi import BaseContext

from app.core.db import session_dependency
from app.core.errors import AppError, Forbidden, Unauthorized
from app.graphql.dataloaders import Loaders
from app.ratelimit import service as ratelimit
from app.tenancy.auth import Credential, authenticate, charge_anonymous, credential_of
from app.tenancy.principal import AuthContext


def coded(e: AppError) -> GraphQLError:
    """A service's refusal as a GraphQL error: REST's code and status in its extensions."""
    return GraphQLError(e.detail, extensions={"code": e.code, "status": e.status, **e.extra})


class Context(BaseContext):
    """Database work runs on the thread pool, never on the event loop (a slow bill must not
    stall every other request of the process), one piece at a time per context: the session is
    the context's, and sessions are not for two threads at once. `run` is that door."""

    def __init__(self, auth: AuthContext | None, session: Session):
        super().__init__()
        self._auth = auth
        self._auth_error: AppError | None = None  # a websocket's refused key, told on use
        self.session = session
        self.ws_scope: Any = None  # a websocket's ASGI scope (rate limits per operation)
        self.lock = asyncio.Lock()
        self.fresh_loaders()

    def fresh_loaders(self) -> None:
        """Loaders for one operation (a websocket's context lives for many: each operation
        reads the database as it is now, and caches nothing past its end)."""
        self.loaders = Loaders.build(self._locked, lambda: self.session, lambda: self.auth)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the thread pool, alone on this context's session; a service's
        refusal (AppError) becomes the GraphQL error with REST's code (and status)."""
        async with self.lock:
            try:
                return await run_in_threadpool(fn, *args)
            except AppError as e:
                raise coded(e) from e

    def _locked(self, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        async def load(keys: list[Any]) -> Any:
            return await self.run(fn, keys)

        return load

    @property
    def caller(self) -> AuthContext | None:
        """The authenticated caller, or None (anonymous, or a websocket whose key was refused)."""
        return self._auth

    @property
    def auth(self) -> AuthContext:
        if self._auth is None:
            if self._auth_error is not None:
                raise self._auth_error
            raise Unauthorized(
                "Send an API key as `Authorization: Bearer rp_...`.", code="missing_api_key"
            )
        return self._auth


Info = strawberry.Info[Context, None]  # a resolver's `info`, its context typed


async def sign_in(context: Context, cred: Credential, scope: Any, kind: str = "read") -> None:
    """Check a websocket's credential as REST checks a request's, and take a token of the
    caller's `kind` rate limit: when it connects, and again for every operation on it
    (app/graphql/extensions.py `PerOperation`). A refusal is kept to answer the operation with.

    A portal session's cookie rides on the handshake of any page the browser opens, so it
    counts only from a page of this origin (a websocket has no CSRF header: its Origin is the
    check, as OWASP advises against cross-site websocket hijacking)."""
    context._ws_cred = cred  # type: ignore[attr-defined]
    context.ws_scope = scope
    try:
        if cred.kind == "session" and not _same_origin(scope):
            raise Forbidden(
                "A portal session's websocket must come from the portal's own origin.",
                code="cross_origin_websocket",
            )
        auth = await cred.resolve()
        await ratelimit.check_async(
            scope,
            kind,
            key=str(auth.key_id),
            tenant=str(auth.tenant_id),
            operator=auth.tenant_id is None,
        )
    except AppError as e:
        context._auth, context._auth_error = None, e
        return
    context._auth, context._auth_error = auth, None


def _same_origin(scope: Any) -> bool:
    headers = {
        k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
    }
    origin = headers.get("origin")
    if not origin:  # browsers always send one; a cookie without it is no page's
        return False
    hosts = {headers.get("host"), headers.get("x-forwarded-host")} - {None}
    return urlsplit(origin).netloc in hosts


async def get_context(
    request: HTTPConnection, session: Session = Depends(session_dependency)
) -> Context:
    """The caller from the same API keys as REST. Without a key the context has no caller:
    GraphiQL's page loads, and every field that needs one answers `missing_api_key`. A
    websocket's key (its handshake's header, else its `connection_init` payload: see
    app/graphql/subscriptions.py) is checked when it connects; a refused one is the error of
    every operation on it, with REST's code, rather than a closed socket."""
    if request.scope["type"] == "websocket":
        context = Context(None, session)
        cred = credential_of(request)
        if cred is not None:
            await sign_in(context, cred, request.scope)
        return context
    if credential_of(request) is None:
        # Anonymous: its address pays for the request before anything is parsed or run.
        charge_anonymous(request)
        return Context(None, session)
    return Context(await authenticate(request), session)  # type: ignore[arg-type]
