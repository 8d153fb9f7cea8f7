"""What a query may cost, checked before it runs.

Strawberry's limiters bound depth, aliases and tokens; `Cost` bounds the work: each field
costs 1, and a field returning a page costs its children once per item it may return (its
`first`, else the page's default), so `workloads(first: 500) { edges { node { events } } }`
costs what 500 workloads with their events cost, however few the tenant has. The estimate is
an upper bound from the query alone, as GitHub's and Shopify's are: the same query always gets
the same answer, before any row is read.

Every limit's refusal carries a code in its extensions, as every other error does.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from graphql import (
    FieldNode,
    FragmentSpreadNode,
    GraphQLError,
    InlineFragmentNode,
    OperationDefinitionNode,
    SelectionSetNode,
    ValidationRule,
    VariableNode,
)
from strawberry.extensions import AddValidationRules, SchemaExtension

from app.core.errors import AppError

# Fields that return a page: the default page size when `first` is not given.
PAGED = {"workloads": 50, "nodes": 50, "apiKeys": 50, "regions": 50, "racks": 50, "tenants": 50}
# Lists a field returns without paging, and their most: a workload's newest events (see
# app/graphql/context.py), a node's GPUs, a GPU's holders (MIG slots), a workload's replicas.
BOUNDED = {"events": 20, "gpus": 8, "holders": 7, "placement": 8}

MASKED = "Internal error"
_VARIABLES: ContextVar[dict[str, Any] | None] = ContextVar("graphql_variables", default=None)

# Strawberry's limiters report errors without a code: theirs, by what their message says.
_CODES = (
    ("exceeds maximum operation depth of", "query_too_deep"),
    ("aliases found. Allowed:", "too_many_aliases"),
    ("Document contains more than", "too_many_tokens"),
)


def cost_rule(limit: int) -> type[ValidationRule]:
    class CostLimit(ValidationRule):
        def enter_operation_definition(self, node: OperationDefinitionNode, *_: Any) -> None:
            fragments = {
                f.name.value: f
                for f in self.context.document.definitions
                if f.__class__.__name__ == "FragmentDefinitionNode"
            }
            # A variable left out takes its default: `query($n: Int = 500)` costs 500 items.
            defaults = {
                d.variable.name.value: getattr(d.default_value, "value", None)
                for d in node.variable_definitions or ()
                if d.default_value is not None
            }
            variables = {**defaults, **(_VARIABLES.get() or {})}
            total = _cost(node.selection_set, fragments, variables, set())
            if total > limit:
                self.report_error(
                    GraphQLError(
                        f"This query may cost {total:,} (each field 1, each page item its "
                        f"fields); the most is {limit:,}. Ask for smaller pages or fewer fields.",
                        node,
                        extensions={"code": "query_too_costly", "cost": total, "limit": limit},
                    )
                )

    return CostLimit


def _first(field: FieldNode, variables: dict[str, Any]) -> int | None:
    for arg in field.arguments or ():
        if arg.name.value != "first":
            continue
        value = arg.value
        if isinstance(value, VariableNode):
            got = variables.get(value.name.value)
        else:
            got = getattr(value, "value", None)
        try:
            return max(0, int(got)) if got is not None else None
        except (TypeError, ValueError):
            return None  # the field's own check refuses it
    return None


def _cost(
    selections: SelectionSetNode | None,
    fragments: dict[str, Any],
    variables: dict[str, Any],
    seen: set[str],
) -> int:
    if selections is None:
        return 0
    total = 0
    for sel in selections.selections:
        if isinstance(sel, FieldNode):
            name = sel.name.value
            inner = _cost(sel.selection_set, fragments, variables, seen)
            if name in PAGED:
                many = _first(sel, variables) or PAGED[name]
            else:
                many = BOUNDED.get(name, 1)
            total += 1 + many * inner
        elif isinstance(sel, InlineFragmentNode):
            total += _cost(sel.selection_set, fragments, variables, seen)
        elif isinstance(sel, FragmentSpreadNode):
            name = sel.name.value
            if name in seen or name not in fragments:  # a cycle is graphql-core's to refuse
                continue
            total += _cost(fragments[name].selection_set, fragments, variables, seen | {name})
    return total


class Variables(SchemaExtension):
    """Hands the operation's variables to the cost rule (validation rules do not see them)."""

    def on_operation(self):  # type: ignore[override]
        token = _VARIABLES.set(self.execution_context.variables or {})
        try:
            yield
        finally:
            _VARIABLES.reset(token)


class LimitCodes(SchemaExtension):
    """Every error gets a code: a service's AppError REST's (and its status), the limiters'
    refusals theirs, a query's own syntax, validation or variable errors theirs."""

    def on_validate(self):  # type: ignore[override]
        yield
        _coded(self.execution_context.pre_execution_errors)

    def on_operation(self):  # type: ignore[override]
        yield
        ctx = self.execution_context
        _coded(ctx.pre_execution_errors)
        for error in getattr(ctx.result, "errors", None) or []:
            if isinstance(error.original_error, AppError):  # a service's refusal: REST's code
                e = error.original_error
                error.extensions = {"code": e.code, "status": e.status, **e.extra}
                continue
            if (error.extensions or {}).get("code"):
                continue
            if error.message == MASKED:  # logged with the request id where it was masked
                code = "internal_error"
            elif error.message.startswith("Variable '$"):
                code = "invalid_variables"
            else:  # a value the schema's scalars refuse (a BigInt that is not an integer...)
                code = "graphql_validation_failed"
            error.extensions = {**(error.extensions or {}), "code": code}


def _coded(errors: list[GraphQLError] | None) -> None:
    for error in errors or []:
        if error.original_error is None and not (error.extensions or {}).get("code"):
            code = next((c for words, c in _CODES if words in error.message), None)
            if code is None:  # not a limit: the query is not valid GraphQL for this schema
                syntax = error.message.startswith("Syntax Error")
                code = "graphql_syntax_error" if syntax else "graphql_validation_failed"
            error.extensions = {**(error.extensions or {}), "code": code}


def cost_limiter(limit: int) -> AddValidationRules:
    return AddValidationRules([cost_rule(limit)])
