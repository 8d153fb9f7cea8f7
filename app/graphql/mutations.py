"""Mutations: the same service calls as REST's routes, committed before the answer (as REST's
routing layer does, audit entry included), each returning its result or a typed error that
carries REST's stable code."""

from __future__ import annotations

from typing import Annotated, Any

import strawberry
from pydantic import ValidationError as PydanticError
from strawberry.scalars import JSON

from app.core.db import finish_request_session
from app.core.errors import AppError, Conflict, Forbidden, NotFound, ValidationFailed
from app.graphql.context import Context
from app.graphql.types import Workload
from app.tenancy.auth import require_tenant_scope


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


WorkloadResult = Annotated[
    Workload
    | ValidationProblem
    | QuotaExceeded
    | IsolationRuleViolated
    | BudgetExhausted
    | NotFoundProblem
    | ConflictProblem
    | ForbiddenProblem,
    strawberry.union("WorkloadResult"),
]


def problem(e: AppError) -> Any:
    """The typed error for an AppError, by its class (and code)."""
    from app.billing.budgets import BudgetExhausted as Exhausted
    from app.workloads.service import QuotaLimitExceeded
    from app.workloads.tiers import IsolationRefused

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
        return ValidationProblem(code=e.code, message=e.detail, fields=[])
    raise e


def _invalid(exc: PydanticError) -> ValidationProblem:
    fields = [
        FieldProblem(path=["input", *[str(p) for p in err["loc"]]], message=err["msg"])
        for err in exc.errors()
    ]
    return ValidationProblem(
        code="validation_error",
        message="; ".join(f"{'.'.join(f.path)}: {f.message}" for f in fields),
        fields=fields,
    )


def _commit(info: strawberry.Info[Context, None], name: str, params: dict, result: Any) -> None:
    """Commit where the mutation ran, with the request's audit entry, as REST routes do."""
    from app.core.routing import AFTER_COMMIT, BEFORE_COMMIT

    session = info.context.session
    for hook in BEFORE_COMMIT:
        hook(session, f"/graphql:{name}", 200, params, result)
    finish_request_session(session)
    for after in AFTER_COMMIT:
        after()


@strawberry.type
class Mutation:
    @strawberry.mutation(
        description="Submit a workload (REST: POST /v1/workloads; the same fields, as JSON)"
    )
    def submit_workload(self, info: strawberry.Info[Context, None], input: JSON) -> WorkloadResult:
        from app.workloads import service
        from app.workloads.schemas import WorkloadCreate

        ctx = info.context
        try:
            require_tenant_scope(ctx.auth, "write")
            body = WorkloadCreate.model_validate(input)
            w = service.submit(ctx.session, ctx.auth, body)
        except PydanticError as e:
            ctx.session.rollback()
            return _invalid(e)
        except AppError as e:
            ctx.session.rollback()
            return problem(e)
        _commit(info, "submitWorkload", {"body": body}, w)
        return Workload.of(w)

    @strawberry.mutation(description="Terminate a workload (REST: DELETE /v1/workloads/{id})")
    def terminate_workload(
        self, info: strawberry.Info[Context, None], id: strawberry.ID
    ) -> WorkloadResult:
        from app.tenancy.scoping import get_owned
        from app.workloads import service
        from app.workloads.models import Workload as Row

        ctx = info.context
        try:
            require_tenant_scope(ctx.auth, "write")
            w = get_owned(ctx.session, ctx.auth, Row, str(id), what="workload", for_update=True)
            service.terminate(ctx.session, w)
        except AppError as e:
            ctx.session.rollback()
            return problem(e)
        _commit(info, "terminateWorkload", {"workload_id": str(id)}, w)
        return Workload.of(w)
