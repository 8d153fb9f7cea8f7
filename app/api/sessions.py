"""Portal sign-in: `POST /v1/sessions` trades an API key for an HttpOnly session cookie;
`GET /v1/sessions/current` says who is signed in (and the CSRF token); `DELETE` signs out."""

from __future__ import annotations

from fastapi import Depends, Request, Response
from fastapi.security import APIKeyCookie
from starlette.concurrency import run_in_threadpool

from app.audit.service import note_principal
from app.core.db import session_scope
from app.core.errors import Unauthorized
from app.core.routing import api_router
from app.ratelimit import service as ratelimit
from app.sessions import service
from app.sessions.schemas import SessionOut, SignIn
from app.tenancy.auth import SESSION_COOKIE, Credential, check_csrf, credential_of
from app.tenancy.principals import resolve_key, resolve_session

router = api_router(prefix="/v1", tags=["sessions"])
SIGNED_IN_COOKIE = "rp_signed_in"


def _signin_limit(request: Request) -> None:
    # Until it succeeds a sign-in is a guess at a key: limited per client address.
    ratelimit.check(
        request.scope, "signin", address=request.client.host if request.client else "unknown"
    )


def _set_cookie(request: Request, response: Response, token: str, max_age: int) -> None:
    secure = request.url.scheme == "https"
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=max_age,
        path="/",
        httponly=True,
        samesite="strict",
        secure=secure,
    )
    # No secret: it only tells the page, which cannot read the session cookie, that asking
    # who is signed in is worth a request.
    response.set_cookie(
        SIGNED_IN_COOKIE, "1", max_age=max_age, path="/", samesite="strict", secure=secure
    )


_session_cookie = APIKeyCookie(
    name=SESSION_COOKIE, auto_error=False, description="A portal session (`POST /v1/sessions`)"
)


def _cookie(request: Request, _c: str | None = Depends(_session_cookie)) -> str:
    cred = credential_of(request)
    if cred is None or cred.kind != "session":
        raise Unauthorized("No portal session: sign in first.", code="no_session")
    return cred.raw


@router.post(
    "/sessions",
    status_code=201,
    response_model=SessionOut,
    summary="Sign in to the portal: an API key for a session cookie (HttpOnly, SameSite)",
)
async def sign_in(
    body: SignIn,
    request: Request,
    response: Response,
    _limit: None = Depends(_signin_limit),
) -> SessionOut:
    auth = await resolve_key(body.api_key)
    note_principal(auth)

    def write() -> tuple[str, SessionOut]:
        with session_scope() as session:
            return service.open_session(session, auth, request.headers.get("user-agent", ""))

    token, out = await run_in_threadpool(write)
    max_age = int((out.expires_at - out.created_at).total_seconds())
    _set_cookie(request, response, token, max_age)
    response.headers["Cache-Control"] = "no-store"
    return out


@router.get(
    "/sessions/current",
    response_model=SessionOut,
    summary="The signed-in portal session and its CSRF token",
)
async def current(
    request: Request, response: Response, token: str = Depends(_cookie)
) -> SessionOut:
    auth = await resolve_session(token)
    note_principal(auth)

    def read() -> SessionOut:
        with session_scope() as session:
            row = service.find(session, token)
            if row is None:  # purged between the two reads
                raise Unauthorized(
                    "The session is not valid; sign in again.", code="invalid_session"
                )
            return service.describe(row, auth, token)

    response.headers["Cache-Control"] = "no-store"
    return await run_in_threadpool(read)


@router.delete(
    "/sessions/current",
    status_code=204,
    summary="Sign out: the session ends at once, on every API process",
)
async def sign_out(request: Request, token: str = Depends(_cookie)) -> Response:
    try:
        auth = await resolve_session(token)
    except Unauthorized:  # already over: only the cookie is left to clear
        auth = None
    if auth is not None:
        note_principal(auth)
        check_csrf(request, Credential("session", token))  # no signing others out from afar

        def write() -> None:
            with session_scope() as session:
                service.close(session, token)

        await run_in_threadpool(write)
    out = Response(status_code=204)
    secure = request.url.scheme == "https"
    out.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=secure)
    out.delete_cookie(SIGNED_IN_COOKIE, path="/", samesite="strict", secure=secure)
    return out
