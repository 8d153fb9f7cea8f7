"""Mutations: the same service calls as REST's routes, committed before the answer (as REST's
routing layer does, audit entry included), each returning its result or a typed error that
carries REST's stable code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Union

import strawberry
from pydantic import ValidationError as PydanticError

from app.audit.service import record_operation
from app.billing import budgets
from app.billing.schemas import BudgetIn, BudgetOut
from app.core.db import finish_request_session
from app.core.errors import AppError, Conflict, Forbidden, NotFound, ValidationFailed
from app.core.logging import get_logger
from app.graphql.account import WorkloadInput
from app.graphql.context import Context
from app.graphql.types import Workload, WorkloadEvent
from app.graphql.views import input_view, parse, shape, view
from app.keys.schemas import KeyCreate, KeyCreated, KeyOut
from app.keys.service import create_key, revoke
from app.models.keys import ApiKey
from app.models.tenants import Tenant
from app.models.workloads import Workload as Row
from app.tenancy.auth import require_tenant_scope
from app.tenancy.scoping import get_owned
from app.workloads import service
from app.workloads.budget_gate import BudgetExhausted as Exhausted
from app.workloads.schemas import CheckpointIn, WorkloadCreate
from app.workloads.service import QuotaLimitExceeded
from app.workloads.tiers import IsolationRefused

log = get_logger(__name__)


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
        return ValidationProblem(code=e.code, message=e.detail, fields=fields)
    raise e


def _invalid(exc: PydanticError) -> ValidationProblem:
    from app.graphql.views import camel

    fields = [
        FieldProblem(
            path=["input", *[camel(p) if isinstance(p, str) else str(p) for p in err["loc"]]],
            message=err["msg"],
        )
        for err in exc.errors()
    ]
    return ValidationProblem(
        code="validation_error",
        message="; ".join(f"{'.'.join(f.path)}: {f.message}" for f in fields),
        fields=fields,
    )


def _commit(info: strawberry.Info[Context, None], name: str, params: dict, result: Any) -> None:
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
    import re

    noun = re.sub(r"(?<!^)([A-Z])", r"_\1", re.sub(r"^[a-z]+", "", name)).lower()
    found = getattr(result, "id", None)
    if found is None:
        found = next((v for k, v in params.items() if k.endswith("_id")), None)
    return noun, str(found) if found is not None else None


def _refused(info: strawberry.Info[Context, None], name: str, status: int) -> None:
    """A mutation refused (or failed) is in the audit log too, with REST's status."""
    record_operation(None, info.context._auth, f"/graphql:{name}", status)


def _run(info: strawberry.Info[Context, None], name: str, act: Callable[[], Any]) -> Any:
    """Run a mutation's service calls: committed with its audit entry when they succeed, rolled
    back (nothing half-written) and answered with the typed error when they fail."""
    session = info.context.session
    try:
        params, result, answer = act()
    except PydanticError as e:
        session.rollback()
        _refused(info, name, 422)
        return _invalid(e)
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


@strawberry.type(description="Done; nothing to return")
class Done:
    ok: bool = True


def _results(name: str, *types: Any) -> Any:
    return Annotated[
        Union[  # noqa: UP007 - a union built from a tuple of types
            (
                *types,
                ValidationProblem,
                QuotaExceeded,
                IsolationRuleViolated,
                BudgetExhausted,
                NotFoundProblem,
                ConflictProblem,
                ForbiddenProblem,
                InternalProblem,
            )
        ],
        strawberry.union(name),
    ]


NewApiKey = view(KeyCreated, "NewApiKey", "A new API key: `key` is its secret, shown only now")
ApiKeyView = view(KeyOut, "ApiKey")
BudgetView = view(BudgetOut, "Budget")
BudgetInput = input_view(BudgetIn, "BudgetInput")
KeyInput = input_view(KeyCreate, "ApiKeyInput")
CheckpointInput = input_view(CheckpointIn, "CheckpointInput")
CheckpointResult = _results("CheckpointResult", WorkloadEvent)
NewApiKeyResult = _results("NewApiKeyResult", NewApiKey)
ApiKeyResult = _results("ApiKeyResult", ApiKeyView)
BudgetResult = _results("BudgetResult", BudgetView)
DoneResult = _results("DoneResult", Done)
WorkloadResult = _results("WorkloadResult", Workload)


@strawberry.type
class AccountMutation:
    @strawberry.mutation(description="Submit a workload (REST: POST /v1/workloads)")
    def submit_workload(
        self, info: strawberry.Info[Context, None], input: WorkloadInput
    ) -> WorkloadResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(WorkloadCreate, input)
            w = service.submit(ctx.session, ctx.auth, body)
            return {"body": body}, w, Workload.of(w)

        return _run(info, "submitWorkload", act)

    @strawberry.mutation(description="Terminate a workload (REST: DELETE /v1/workloads/{id})")
    def terminate_workload(
        self, info: strawberry.Info[Context, None], id: strawberry.ID
    ) -> WorkloadResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            w = _workload(ctx, id)
            service.terminate(ctx.session, w)
            return {"workload_id": str(id)}, w, Workload.of(w)

        return _run(info, "terminateWorkload", act)

    @strawberry.mutation(
        description="Report a completed checkpoint: preemption or a fault then loses only later "
        "work (REST: POST /v1/workloads/{id}/checkpoints)"
    )
    def report_checkpoint(
        self, info: strawberry.Info[Context, None], id: strawberry.ID, input: CheckpointInput
    ) -> CheckpointResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(CheckpointIn, input)
            w = _workload(ctx, id)
            ev = service.report_checkpoint(ctx.session, w, body.completed_at, body.size_bytes)
            return {"workload_id": str(id), "body": body}, ev, WorkloadEvent.of(ev)

        return _run(info, "reportCheckpoint", act)

    @strawberry.mutation(description="Create an API key; its secret is in this answer only")
    def create_api_key(
        self, info: strawberry.Info[Context, None], input: KeyInput
    ) -> NewApiKeyResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "admin")
            body = parse(KeyCreate, input)
            made = create_key(
                ctx.session,
                tenant_id=ctx.auth.tenant_id,
                name=body.name,
                scopes=list(body.scopes),
                expires_at=body.expires_at,
            )
            return {"body": body}, made, shape(KeyCreated, made)

        return _run(info, "createApiKey", act)

    @strawberry.mutation(description="Revoke an API key (effective on its next request)")
    def revoke_api_key(
        self, info: strawberry.Info[Context, None], id: strawberry.ID
    ) -> ApiKeyResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "admin")
            key = revoke(get_owned(ctx.session, ctx.auth, ApiKey, str(id), what="key"))
            return {"key_id": str(id)}, key, shape(KeyOut, key)

        return _run(info, "revokeApiKey", act)

    @strawberry.mutation(description="Set your monthly budget (spend and/or GPU-hours)")
    def set_budget(self, info: strawberry.Info[Context, None], input: BudgetInput) -> BudgetResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(BudgetIn, input)
            tenant = get_owned(ctx.session, ctx.auth, Tenant, ctx.auth.tenant_id, what="tenant")
            budgets.set_budget(ctx.session, tenant.id, **body.model_dump())
            out = budgets.view(ctx.session, ctx.auth, tenant.id)
            return {"body": body}, out, shape(BudgetOut, out)

        return _run(info, "setBudget", act)

    @strawberry.mutation(description="Remove your budget (no limits)")
    def remove_budget(self, info: strawberry.Info[Context, None]) -> DoneResult:
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            budgets.remove(ctx.session, ctx.auth)
            return {}, None, Done()

        return _run(info, "removeBudget", act)


def _workload(ctx: Context, id: Any) -> Any:
    return get_owned(ctx.session, ctx.auth, Row, str(id), what="workload", for_update=True)
