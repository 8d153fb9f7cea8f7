"""What a query may cost, checked before it runs.

Depth and aliases are bounded here (Strawberry's limiters walk each fragment once per path
that reaches it: a fragment spreading the next twice, forty deep, never finished), tokens by
Strawberry's; `Cost` bounds the work: each field
costs 1, and a field returning a page costs its children once per item it may return (its
`first`, else the page's default), so `workloads(first: 500) { edges { node { events } } }`
costs what 500 workloads with their events cost, however few the tenant has. The estimate is
an upper bound from the query alone, as GitHub's and Shopify's are: the same query always gets
the same answer, before any row is read.

Who may ask what, also before it runs:
- **Introspection** (`__schema`, `__type`) answers only a caller with a key, once per
  operation: an anonymous schema walk costs a page of answer for a few bytes of question.
- **Expensive fields** (REST's `expensive` class: usage, utilisation, reconciliation) take one
  token of that class each, aliases included, as REST's routes do: fifteen aliased `usage`
  fields are fifteen usage scans, not one request.
- **The body** is parsed with its nesting bounded (`MAX_JSON_DEPTH`): a thousand nested
  variables are a 400, not a recursion.

Every limit's refusal carries a code in its extensions, as every other error does.
"""

from __future__ import annotations

import json
import re
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
from app.ratelimit import service as ratelimit

# Fields that return a page: the default page size when `first` is not given.
PAGED = {
    "workloads": 50,
    "nodes": 50,
    "apiKeys": 50,
    "regions": 50,
    "racks": 50,
    "tenants": 50,
    "chaosExperiments": 50,
}
# Lists a field returns without paging, and their most: a workload's newest events (see
# app/graphql/context.py), a node's GPUs, a GPU's holders (MIG slots), a workload's replicas.
BOUNDED = {"events": 20, "gpus": 8, "holders": 7, "placement": 8}

# Root fields that cost what REST's `expensive` routes cost (app/ratelimit), one token each.
EXPENSIVE = frozenset({"usage", "utilisation", "reconciliation"})
INTROSPECTION = frozenset({"__schema", "__type"})
# No input of the schema nests near this deep; a body that does is refused before it is read.
MAX_JSON_DEPTH = 32

MASKED = "Internal error"
_VARIABLES: ContextVar[dict[str, Any] | None] = ContextVar("graphql_variables", default=None)
# The operation's context (app/graphql/context.Context): who asks, for the rules that care.
_CONTEXT: ContextVar[Any] = ContextVar("graphql_context", default=None)

# Strawberry's token limiter reports errors without a code: its, by what its message says.
_CODES = (("Document contains more than", "too_many_tokens"),)


def _fragments(document: Any) -> dict[str, Any]:
    return {
        f.name.value: f
        for f in document.definitions
        if f.__class__.__name__ == "FragmentDefinitionNode"
    }


def _nesting(
    selections: SelectionSetNode | None,
    fragments: dict[str, Any],
    seen: frozenset[str],
    memo: dict[str, int],
) -> int:
    """How many levels of fields with fields of their own `selections` go down (as Strawberry
    counts depth: `{ a { b } }` is 1; introspection fields have their own limit), each
    fragment measured once (`memo`)."""
    deepest = 0
    for sel in selections.selections if selections is not None else ():
        if isinstance(sel, FieldNode):
            if sel.selection_set is not None and not sel.name.value.startswith("__"):
                deepest = max(deepest, 1 + _nesting(sel.selection_set, fragments, seen, memo))
        elif isinstance(sel, InlineFragmentNode):
            deepest = max(deepest, _nesting(sel.selection_set, fragments, seen, memo))
        elif isinstance(sel, FragmentSpreadNode):
            name = sel.name.value
            if name in seen or name not in fragments:  # a cycle is graphql-core's to refuse
                continue
            if name not in memo:
                memo[name] = _nesting(fragments[name].selection_set, fragments, seen | {name}, memo)
            deepest = max(deepest, memo[name])
    return deepest


def depth_rule(limit: int) -> type[ValidationRule]:
    class DepthLimit(ValidationRule):
        def enter_operation_definition(self, node: OperationDefinitionNode, *_: Any) -> None:
            fragments = _fragments(self.context.document)
            depth = _nesting(node.selection_set, fragments, frozenset(), {})
            if depth > limit:
                name = node.name.value if node.name else "anonymous"
                self.report_error(
                    GraphQLError(
                        f"'{name}' exceeds maximum operation depth of {limit} (it is {depth}).",
                        node,
                        extensions={"code": "query_too_deep", "depth": depth, "limit": limit},
                    )
                )

    return DepthLimit


def _aliases(
    selections: SelectionSetNode | None,
    fragments: dict[str, Any],
    seen: frozenset[str],
    memo: dict[str, int],
) -> int:
    """Aliased fields under `selections`, a fragment's counted each time it is spread (as
    Strawberry counts them), each fragment walked once."""
    total = 0
    for sel in selections.selections if selections is not None else ():
        if isinstance(sel, FieldNode):
            total += sel.alias is not None
            total += _aliases(sel.selection_set, fragments, seen, memo)
        elif isinstance(sel, InlineFragmentNode):
            total += _aliases(sel.selection_set, fragments, seen, memo)
        elif isinstance(sel, FragmentSpreadNode):
            name = sel.name.value
            if name in seen or name not in fragments:
                continue
            if name not in memo:
                memo[name] = _aliases(fragments[name].selection_set, fragments, seen | {name}, memo)
            total += memo[name]
    return total


def alias_rule(limit: int) -> type[ValidationRule]:
    class AliasLimit(ValidationRule):
        def __init__(self, context: Any) -> None:
            super().__init__(context)
            document = context.document
            fragments, memo = _fragments(document), {}
            total = sum(
                _aliases(d.selection_set, fragments, frozenset(), memo)
                for d in document.definitions
                if isinstance(d, OperationDefinitionNode)
            )
            if total > limit:
                context.report_error(
                    GraphQLError(
                        f"{total} aliases found. Allowed: {limit}",
                        extensions={"code": "too_many_aliases", "aliases": total, "limit": limit},
                    )
                )

    return AliasLimit


def cost_rule(limit: int) -> type[ValidationRule]:
    class CostLimit(ValidationRule):
        def enter_operation_definition(self, node: OperationDefinitionNode, *_: Any) -> None:
            fragments = _fragments(self.context.document)
            # A variable left out takes its default: `query($n: Int = 500)` costs 500 items.
            defaults = {
                d.variable.name.value: getattr(d.default_value, "value", None)
                for d in node.variable_definitions or ()
                if d.default_value is not None
            }
            variables = {**defaults, **(_VARIABLES.get() or {})}
            total = _cost(node.selection_set, fragments, variables, frozenset(), {})
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
    seen: frozenset[str],
    memo: dict[str, int],
) -> int:
    """What `selections` may cost. Each fragment is costed once (`memo`): a fragment that
    spreads another twice, nested, would otherwise take time exponential in the nesting."""
    if selections is None:
        return 0
    total = 0
    for sel in selections.selections:
        if isinstance(sel, FieldNode):
            name = sel.name.value
            inner = _cost(sel.selection_set, fragments, variables, seen, memo)
            if name in PAGED:
                many = _first(sel, variables) or PAGED[name]
            else:
                many = BOUNDED.get(name, 1)
            total += 1 + many * inner
        elif isinstance(sel, InlineFragmentNode):
            total += _cost(sel.selection_set, fragments, variables, seen, memo)
        elif isinstance(sel, FragmentSpreadNode):
            name = sel.name.value
            if name in seen or name not in fragments:  # a cycle is graphql-core's to refuse
                continue
            if name not in memo:
                memo[name] = _cost(
                    fragments[name].selection_set, fragments, variables, seen | {name}, memo
                )
            total += memo[name]
    return total


def _expensive_roots(
    selections: SelectionSetNode,
    fragments: dict[str, Any],
    seen: frozenset[str] = frozenset(),
    memo: dict[str, int] | None = None,
) -> int:
    """How many of the operation's root fields are expensive, through fragments (aliases are
    fields of their own; each fragment counted once, as in `_cost`)."""
    memo = {} if memo is None else memo
    out = 0
    for sel in selections.selections:
        if isinstance(sel, FieldNode):
            out += sel.name.value in EXPENSIVE
        elif isinstance(sel, InlineFragmentNode):
            out += _expensive_roots(sel.selection_set, fragments, seen, memo)
        elif isinstance(sel, FragmentSpreadNode):
            name = sel.name.value
            if name not in seen and name in fragments:
                if name not in memo:
                    memo[name] = _expensive_roots(
                        fragments[name].selection_set, fragments, seen | {name}, memo
                    )
                out += memo[name]
    return out


# How deep an introspection field's selection may go: graphql-core's own introspection query
# (what GraphiQL and code generators send) is 14 levels under `__schema`; 16 leaves room for a
# client's deeper `ofType` chain.
MAX_INTROSPECTION_DEPTH = 16


def _depth(
    node: Any,
    fragment: Any,
    seen: frozenset[str] = frozenset(),
    memo: dict[str, int] | None = None,
) -> int:
    """Levels of fields under `node` (fragments followed, each once per path and measured
    once: see `_cost`)."""
    memo = {} if memo is None else memo
    selections = node.selection_set.selections if node.selection_set is not None else ()
    deepest = 0
    for sel in selections:
        if isinstance(sel, FieldNode):
            deepest = max(deepest, 1 + _depth(sel, fragment, seen, memo))
        elif isinstance(sel, FragmentSpreadNode):
            name = sel.name.value
            if name not in memo:
                frag = fragment(name) if name not in seen else None
                if frag is None:
                    continue
                memo[name] = _depth(frag, fragment, seen | {name}, memo)
            deepest = max(deepest, memo[name])
        else:  # an inline fragment
            deepest = max(deepest, _depth(sel, fragment, seen, memo))
    return deepest


class Introspection(ValidationRule):
    """`__schema` and `__type` answer a caller with a key, and `__schema` once per operation."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.schemas = 0
        self.refused = False

    def enter_field(self, node: FieldNode, *_: Any) -> None:
        name = node.name.value
        if name not in INTROSPECTION:
            return
        if getattr(_CONTEXT.get(), "caller", None) is None:
            if not self.refused:
                self.refused = True
                self.report_error(
                    GraphQLError(
                        "The schema is described to callers with an API key: send "
                        "`Authorization: Bearer rp_...` (or read sdl/schema.graphql).",
                        node,
                        extensions={"code": "introspection_requires_key", "status": 401},
                    )
                )
            return
        depth = _depth(node, self.context.get_fragment)
        if depth > MAX_INTROSPECTION_DEPTH:
            # The depth limiter leaves introspection out: a 40-deep `ofType` chain answered.
            self.report_error(
                GraphQLError(
                    f"`{name}` is {depth} levels deep; at most {MAX_INTROSPECTION_DEPTH}.",
                    node,
                    extensions={"code": "query_too_deep"},
                )
            )
            return
        if name == "__schema":
            self.schemas += 1
            if self.schemas == 2:
                self.report_error(
                    GraphQLError(
                        "Ask for `__schema` once per operation.",
                        node,
                        extensions={"code": "too_many_introspections"},
                    )
                )


class ExpensiveFields(ValidationRule):
    """Each expensive root field takes a token of REST's `expensive` class from the caller's
    buckets, all of them at once or none (app/ratelimit), before anything runs."""

    def enter_operation_definition(self, node: OperationDefinitionNode, *_: Any) -> None:
        context = _CONTEXT.get()
        auth = getattr(context, "caller", None)
        if auth is None:  # anonymous: the fields themselves refuse
            return
        fragments = _fragments(self.context.document)
        cost = _expensive_roots(node.selection_set, fragments)
        if not cost:
            return
        conn = getattr(context, "request", None)
        scope = getattr(context, "ws_scope", None) or getattr(conn, "scope", None) or {}
        try:
            ratelimit.check(
                scope,
                "expensive",
                key=str(auth.key_id),
                tenant=str(auth.tenant_id),
                operator=auth.tenant_id is None,
                cost=cost,
            )
        except AppError as e:
            self.report_error(
                GraphQLError(
                    e.detail,
                    node,
                    extensions={"code": e.code, "status": e.status, **e.extra, **e.headers},
                )
            )


class Variables(SchemaExtension):
    """Hands the operation's variables (to the cost rule) and its context (to the rules that
    ask who is calling) to validation, which sees neither."""

    def on_operation(self):  # type: ignore[override]
        token = _VARIABLES.set(self.execution_context.variables or {})
        caller = _CONTEXT.set(self.execution_context.context)
        try:
            yield
        finally:
            _VARIABLES.reset(token)
            _CONTEXT.reset(caller)


class TooDeep(json.JSONDecodeError):
    """A body nested past MAX_JSON_DEPTH (or past what the parser's recursion allows). A kind
    of JSONDecodeError, so a websocket's message that nests too deep closes it as any message
    that is not JSON does (4400)."""

    def __init__(self, data: str | bytes) -> None:
        text = data if isinstance(data, str) else data.decode("utf-8", "replace")
        super().__init__(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", text, 0)


def json_depth(value: Any, limit: int) -> int:
    """How deep `value` nests, counted without recursion, up to `limit + 1`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def load_body(data: str | bytes) -> Any:
    """A request body (or query-string part) as JSON, refusing what nests too deep."""
    try:
        value = json.loads(data)
    except RecursionError as e:
        raise TooDeep(data) from e
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise TooDeep(data)
    return value


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
                error.message = _without_value(error)
            else:  # a value the schema's scalars refuse (a BigInt that is not an integer...)
                code = "graphql_validation_failed"
            error.extensions = {**(error.extensions or {}), "code": code}


_VARIABLE = re.compile(r"^Variable '(\$[A-Za-z_][A-Za-z0-9_]*)' ")
# Where graphql-core's reasons go on to repeat the value they got.
_ECHO = re.compile(r",? found:? |(?<= value): ", re.IGNORECASE)


def _without_value(error: GraphQLError) -> str:
    """graphql-core says which variable did not coerce and repeats the value it got (`got
    invalid value {...}`, `..., found {...}`, `cannot represent a non string value: ...`): a
    secret's value sent with a field missing would come back in the answer, and in whatever
    logs answers. The variable's name and the reason only, the value cut."""
    m = _VARIABLE.match(error.message)
    if m is None:
        return error.message
    rest = error.message[m.end() :]
    if rest.startswith("got invalid value "):
        inner = error.original_error
        reason = inner.message if isinstance(inner, GraphQLError) else "it does not fit its type"
    elif rest.startswith("has invalid value: "):
        reason = rest[len("has invalid value: ") :]
    else:  # not provided, must not be null, not an input type: no value in it
        return error.message
    reason = _ECHO.split(reason, maxsplit=1)[0].rstrip(".")
    return f"Variable '{m.group(1)}' has an invalid value: {reason}."


def _coded(errors: list[GraphQLError] | None) -> None:
    for error in errors or []:
        if error.original_error is None and not (error.extensions or {}).get("code"):
            code = next((c for words, c in _CODES if words in error.message), None)
            if code is None:  # not a limit: the query is not valid GraphQL for this schema
                syntax = error.message.startswith("Syntax Error")
                code = "graphql_syntax_error" if syntax else "graphql_validation_failed"
            error.extensions = {**(error.extensions or {}), "code": code}


def cost_limiter(limit: int) -> AddValidationRules:
    return AddValidationRules([cost_rule(limit), Introspection, ExpensiveFields])
