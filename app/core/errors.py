"""Error hierarchy and RFC 9457 problem+json rendering."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_JSON = "application/problem+json"
PROBLEM_BASE = "https://rackplane.dev/problems/"


class AppError(Exception):
    """Base of every error the API reports on purpose. `code` is stable; `detail` is for humans."""

    status = 400
    code = "bad_request"
    title = "Bad request"

    def __init__(
        self,
        detail: str | None = None,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ):
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        if code:
            self.code = code
        self.headers = headers or {}
        self.extra = extra


class Unauthorized(AppError):
    status, code, title = 401, "unauthorized", "Missing or invalid API key"


class Forbidden(AppError):
    status, code, title = 403, "forbidden", "Not allowed"


class NotFound(AppError):
    status, code, title = 404, "not_found", "Not found"


class Conflict(AppError):
    status, code, title = 409, "conflict", "Conflict"


class ValidationFailed(AppError):
    status, code, title = 422, "validation_error", "Validation failed"


class PayloadTooLarge(AppError):
    status, code, title = 413, "payload_too_large", "Request body too large"


class ServiceUnavailable(AppError):
    status, code, title = 503, "service_unavailable", "Service unavailable"


def problem_body(
    status: int, code: str, title: str, detail: str, instance: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + code,
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    }
    if instance:
        body["instance"] = instance
    body.update(extra)
    return body


def problem_response(
    status: int,
    code: str,
    title: str,
    detail: str,
    request: Request | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    instance = request.url.path if request is not None else None
    return JSONResponse(
        problem_body(status, code, title, detail, instance, **extra),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def format_loc(loc: tuple[Any, ...] | list[Any]) -> str:
    """('body', 'regions', 0, 'name') -> 'body.regions[0].name'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_HTTP_CODES = {
    400: ("bad_request", "Bad request"),
    401: ("unauthorized", "Unauthorized"),
    403: ("forbidden", "Forbidden"),
    404: ("not_found", "Not found"),
    405: ("method_not_allowed", "Method not allowed"),
    406: ("not_acceptable", "Not acceptable"),
    413: ("payload_too_large", "Request body too large"),
    415: ("unsupported_media_type", "Unsupported media type"),
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AppError)
    async def _app_error(request: Request, exc: AppError) -> JSONResponse:
        headers = {**({"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}), **exc.headers}
        return problem_response(
            exc.status, exc.code, exc.title, exc.detail, request, headers=headers, **exc.extra
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":  # say where, as an editor would
                errors.append(await _json_error(request, e))
                continue
            errors.append(
                {
                    "field": format_loc(e.get("loc", ())),
                    "message": e.get("msg", ""),
                    "type": e.get("type", ""),
                }
            )
        fields = ", ".join(e["field"] for e in errors[:5])
        return problem_response(
            422,
            "validation_error",
            "Validation failed",
            f"Invalid request: {fields}",
            request,
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code, title = _HTTP_CODES.get(exc.status_code, ("http_error", "HTTP error"))
        detail = exc.detail if isinstance(exc.detail, str) else title
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette names only the first route whose path matched; every route of this
            # path counts.
            headers["Allow"] = ", ".join(allowed_methods(request))
        return problem_response(exc.status_code, code, title, detail, request, headers=headers)

    @app.exception_handler(IntegrityError)
    async def _integrity(request: Request, exc: IntegrityError) -> JSONResponse:
        # A concurrent request won a uniqueness race the service checked for: nothing was written.
        return problem_response(
            409,
            "conflict",
            "Conflict",
            "The request conflicts with a concurrent change; nothing was written.",
            request,
        )

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        from app.core.logging import get_logger

        get_logger("app.errors").exception("unhandled_error", path=request.url.path)
        if is_unavailable(exc):
            return problem_response(
                503,
                "dependency_unavailable",
                "Service unavailable",
                "A backing service (database or broker) is unreachable; retry shortly.",
                request,
                headers={"Retry-After": "5"},
            )
        return problem_response(
            500,
            "internal_error",
            "Internal server error",
            "An unexpected error occurred; it has been logged.",
            request,
        )


async def _json_error(request: Request, error: dict[str, Any]) -> dict[str, Any]:
    """A body that is not JSON: the parser's complaint at its line and column."""
    loc = error.get("loc", ())
    pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
    text = (await request.body())[:pos].decode("utf-8", "replace")
    line = text.count("\n") + 1
    column = pos - (text.rfind("\n") + 1) + 1 if "\n" in text else pos + 1
    why = (error.get("ctx") or {}).get("error", "invalid JSON")
    return {
        "field": "body",
        "message": f"invalid JSON at line {line}, column {column}: {why}",
        "type": "json_invalid",
        "line": line,
        "column": column,
    }


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app answers on this request's path."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def is_unavailable(exc: BaseException) -> bool:
    """Connection failures to the database or broker are 503, not 500: a refused or reset
    connection, a timeout, and what a PostgreSQL failover looks like from a client (the old
    leader shutting down, a write reaching a node that just became a replica)."""
    from sqlalchemy.exc import OperationalError

    names = {type(e).__name__ for e in _chain(exc)}
    return isinstance(exc, OperationalError) or bool(names & TRANSIENT)


TRANSIENT = frozenset(
    {
        "OperationalError",
        "ConnectionError",
        "ConnectionRefusedError",
        "ConnectionResetError",
        "TimeoutError",
        "ReadOnlySqlTransaction",  # 25006: a write on a node that is a replica now
        "AdminShutdown",  # 57P01: the server is going down (a switchover)
        "CannotConnectNow",  # 57P03: starting up or recovering
        "DisconnectionError",
        "MasterNotFoundError",  # redis: no Sentinel names a master yet
    }
)


def _chain(first: BaseException):
    seen = set()
    exc: BaseException | None = first
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        orig = getattr(exc, "orig", None)  # SQLAlchemy's wrapper of the driver's error
        exc = (orig if isinstance(orig, BaseException) and id(orig) not in seen else None) or (
            exc.__cause__ or exc.__context__
        )
