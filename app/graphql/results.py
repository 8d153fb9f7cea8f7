"""How a mutation runs: the same service calls as REST's routes, committed before the answer (as
REST's routing layer does, audit entry included), each returning its result or a typed error
(app/graphql/problems.py) that carries REST's stable code."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Union

import strawberry
from pydantic import ValidationError as PydanticError

from app.audit.service import record_operation
from app.core.db import finish_request_session
from app.core.errors import AppError
from app.core.logging import get_logger
from app.graphql.context import Info
from app.graphql.problems import PROBLEMS, InternalProblem, invalid, problem

log = get_logger(__name__)


@strawberry.type(description="Done; nothing to return")
class Done:
    ok: bool = True


def result_union(name: str, *types: Any) -> Any:
    """A mutation's result: its answer's types, or one of the typed errors."""
    return Annotated[
        Union[(*types, *PROBLEMS)],  # noqa: UP007 - a union built from a tuple of types
        strawberry.union(name),
    ]


def _commit(info: Info, name: str, params: dict, result: Any) -> None:
    """Commit where the mutation ran, with its own audit entry (as REST routes do: the change
    and its entry in one transaction)."""
    session = info.context.session
    action = f"/graphql:{name}"
    record_operation(
        session, info.context._auth, action, 200, params, result, _target(name, params, result)
    )
    finish_request_session(session)


def _target(name: str, params: dict, result: Any) -> tuple[str, str | None]:
    """What a mutation acted on: `submitWorkload` -> ("workload", its id)."""
    noun = re.sub(r"(?<!^)([A-Z])", r"_\1", re.sub(r"^[a-z]+", "", name)).lower()
    found = getattr(result, "id", None)
    if found is None:
        found = next((v for k, v in params.items() if k.endswith("_id")), None)
    return noun, str(found) if found is not None else None


def _refused(info: Info, name: str, status: int) -> None:
    """A mutation refused (or failed) is in the audit log too, with REST's status."""
    record_operation(None, info.context._auth, f"/graphql:{name}", status)


def run_mutation(info: Info, name: str, act: Callable[[], Any]) -> Any:
    """Run a mutation's service calls (`act`, answering its audit parameters, the object acted
    on and the answer): committed with its audit entry when they succeed, rolled back (nothing
    half-written) and answered with the typed error when they fail."""
    session = info.context.session
    try:
        params, result, answer = act()
    except PydanticError as e:
        session.rollback()
        _refused(info, name, 422)
        return invalid(e)
    except AppError as e:
        session.rollback()
        _refused(info, name, e.status)
        return problem(e)
    except Exception:  # a bug: nothing written, the next mutation of the document still runs
        session.rollback()
        log.exception("graphql_mutation_failed", mutation=name)
        _refused(info, name, 500)
        return InternalProblem(code="internal_error", message="Internal error")
    _commit(info, name, params, result)
    return answer
