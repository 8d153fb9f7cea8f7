"""The typed errors a mutation answers with: REST's stable code and words, one GraphQL type per
kind of refusal, so a client branches on `__typename` (or `code`) rather than parse messages."""

from __future__ import annotations

import re
from typing import Any

import strawberry
from pydantic import ValidationError as PydanticError

from app.core.errors import AppError, Conflict, Forbidden, NotFound, ValidationFailed
from app.graphql.views import camel, field_errors
from app.workloads.budget_gate import BudgetExhausted as Exhausted
from app.workloads.quotas import QuotaLimitExceeded
from app.workloads.tiers import IsolationRefused


@strawberry.type(description="A field of the input and what is wrong with it")
class FieldProblem:
    path: list[str]
    message: str


@strawberry.interface(description="Every typed error: REST's stable code and words")
class Problem:
    code: str
    message: str


@strawberry.type(description="The input is not valid (field paths as in REST's 422)")
class ValidationProblem(Problem):
    fields: list[FieldProblem]


@strawberry.type(description="Past the tenant's GPU quota for a model")
class QuotaExceeded(Problem):
    pass


@strawberry.type(description="The tenant's isolation policy refuses this placement")
class IsolationRuleViolated(Problem):
    pass


@strawberry.type(description="This month's budget is spent and set to block")
class BudgetExhausted(Problem):
    pass


@strawberry.type(description="No such object for this caller (others' objects are not found)")
class NotFoundProblem(Problem):
    pass


@strawberry.type(description="The object's state does not allow it")
class ConflictProblem(Problem):
    pass


@strawberry.type(description="The key may not do this (scope, operator-only, tenant status)")
class ForbiddenProblem(Problem):
    pass


@strawberry.type(description="Something failed on our side; nothing was written (logged)")
class InternalProblem(Problem):
    pass


# Every mutation's result may be one of these, in this order (app/graphql/results.py).
PROBLEMS = (
    ValidationProblem,
    QuotaExceeded,
    IsolationRuleViolated,
    BudgetExhausted,
    NotFoundProblem,
    ConflictProblem,
    ForbiddenProblem,
    InternalProblem,
)


def problem(e: AppError) -> Any:
    """The typed error for an AppError, by its class (and code)."""
    if isinstance(e, QuotaLimitExceeded):
        return QuotaExceeded(code=e.code, message=e.detail)
    if isinstance(e, IsolationRefused):
        return IsolationRuleViolated(code=e.code, message=e.detail)
    if isinstance(e, Exhausted):
        return BudgetExhausted(code=e.code, message=e.detail)
    if isinstance(e, NotFound):
        return NotFoundProblem(code=e.code, message=e.detail)
    if isinstance(e, Conflict):
        return ConflictProblem(code=e.code, message=e.detail)
    if isinstance(e, Forbidden):
        return ForbiddenProblem(code=e.code, message=e.detail)
    if isinstance(e, ValidationFailed):
        fields = [
            FieldProblem(path=[str(p) for p in f.get("path", [])], message=f.get("message", ""))
            for f in e.extra.get("fields") or []
            if isinstance(f, dict)
        ]
        # A service's refusal that names its field as REST's 422s do (`errors[].field`,
        # `body.public_key`): the same field as GraphQL names it (`["input", "publicKey"]`).
        fields += [
            FieldProblem(path=_input_path(f["field"]), message=f.get("message", ""))
            for f in e.extra.get("errors") or []
            if isinstance(f, dict) and str(f.get("field", "")).startswith("body.")
        ]
        return ValidationProblem(code=e.code, message=e.detail, fields=fields)
    raise e


def _input_path(field: str) -> list[str]:
    """REST's `body.gpu_models[0]` as GraphQL's `["input", "gpuModels", "0"]`."""
    parts = re.findall(r"[^.\[\]]+", field.removeprefix("body."))
    return ["input", *(p if p.isdigit() else camel(p) for p in parts)]


def invalid(exc: PydanticError) -> ValidationProblem:
    """An input the REST model refuses, as the typed error (field paths as in REST's 422)."""
    fields = [FieldProblem(path=f["path"], message=f["message"]) for f in field_errors(exc)]
    return ValidationProblem(
        code="validation_error",
        message="; ".join(f"{'.'.join(f.path)}: {f.message}" for f in fields),
        fields=fields,
    )
