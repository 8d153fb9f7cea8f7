"""Routers whose sync endpoints commit their own unit of work.

FastAPI exits a yield dependency of default scope only after the response has been sent, so a
session committed there would answer 201 before its COMMIT, and a failed commit would reach
no one. A sync endpoint that takes the request's session (`session: DbSession`, that is
`Depends(session_dependency)`) is wrapped here so that the commit, and what it releases (outbox
messages, kicks), runs on the endpoint's own worker thread as soon as it returns: before the
response is serialised or sent, and without a second thread-pool hop. `session_dependency` then
only cleans up.

Every endpoint is also where a stored `Idempotency-Key` result is replayed (REPLAY, set by the
idempotency middleware): only after FastAPI has solved the route's dependencies, so a replay
reaches only a caller who authenticated and holds the scope the route asks for now.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Annotated, Any, get_args, get_origin

from fastapi import APIRouter, Depends, params
from fastapi.dependencies.utils import get_typed_signature
from fastapi.responses import Response
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session
from starlette.convertors import Convertor, register_url_convertor
from starlette.routing import compile_path

from app.core.db import finish_request_session, session_dependency

# The request's session, typed: `session: DbSession` is `Depends(session_dependency)`.
DbSession = Annotated[Session, Depends(session_dependency)]


def _depends_on(param: inspect.Parameter, dependency: Callable[..., Any]) -> bool:
    """Whether a parameter is `Depends(dependency)`, as its default or in its `Annotated` type."""
    marks = [param.default]
    if get_origin(param.annotation) is Annotated:
        marks += get_args(param.annotation)[1:]
    return any(isinstance(m, params.Depends) and m.dependency is dependency for m in marks)


def _session_params(endpoint: Callable[..., Any]) -> list[str]:
    # The signature FastAPI reads (string annotations resolved), so an alias counts too.
    return [
        p.name
        for p in get_typed_signature(endpoint).parameters.values()
        if _depends_on(p, session_dependency)
    ]


# Called just before a request's endpoint commits, with (session, route template, status,
# endpoint arguments, result), so what they add is in the same transaction; then, once the
# commit succeeded, with no arguments. The audit log registers here (app/main.py).
BEFORE_COMMIT: list[Callable[..., None]] = []
AFTER_COMMIT: list[Callable[[], None]] = []


def _committing(
    endpoint: Callable[..., Any], name: str, template: str, status: int
) -> Callable[..., Any]:
    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        result = endpoint(*args, **kwargs)
        session = kwargs[name]
        for hook in BEFORE_COMMIT:
            hook(session, template, status, kwargs, result)
        finish_request_session(session)
        for after in AFTER_COMMIT:
            after()
        return result

    return run


class _Segment(Convertor[str]):
    """`{name:segment}`: one path segment without a colon, so `/tenants/{id}` leaves
    `/tenants/{id}:approve` (a custom method, AIP-136 style) to its own route."""

    regex = "[^/:]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("segment", _Segment())


# The stored response to send instead of running the endpoint: (status, headers, body).
REPLAY: ContextVar[tuple[int, dict[str, str], bytes] | None] = ContextVar("replay", default=None)


def stored_response(replay: tuple[int, dict[str, str], bytes]) -> Response:
    status, headers, body = replay
    return Response(body, status, headers={**headers, "Idempotent-Replayed": "true"})


def _replaying(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(endpoint):

        @functools.wraps(endpoint)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            replay = REPLAY.get()
            return stored_response(replay) if replay else await endpoint(*args, **kwargs)

        return run_async

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        replay = REPLAY.get()
        return stored_response(replay) if replay else endpoint(*args, **kwargs)

    return run


class UnitOfWorkRoute(APIRoute):
    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        names = _session_params(endpoint)
        if names and not inspect.iscoroutinefunction(endpoint):
            template = compile_path(path)[1]
            endpoint = _committing(endpoint, names[0], template, kwargs.get("status_code") or 200)
        super().__init__(path, _replaying(endpoint), **kwargs)


def api_router(**kwargs: Any) -> APIRouter:
    """An APIRouter whose sync endpoints commit before they answer (see the module)."""
    return APIRouter(route_class=UnitOfWorkRoute, **kwargs)


# Routes merged into one (issue 48 §3): (method, old path, the path that answers now). The old
# URL still answers the subjects it answered before (an operator's URL, operators only: pass
# its check as `dependencies`), with the merged route's answer; the OpenAPI document lists only
# the merged route.
ALIASES: list[tuple[str, str, str]] = []


def alias(
    router: APIRouter, method: str, path: str, endpoint: Callable[..., Any], to: str, **kwargs: Any
) -> None:
    """Keep `router.prefix + path` working for `method` as `endpoint`, the route at `to`."""
    router.add_api_route(path, endpoint, methods=[method], include_in_schema=False, **kwargs)
    ALIASES.append((method, router.prefix + path, to))
