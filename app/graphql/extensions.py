"""The schema's extensions: database work off the event loop, what each operation of a
websocket starts afresh, the session closed after a mutation, internal errors masked, and a
query text's parse and validation kept for the next time it comes."""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Any

from graphql import GraphQLError, ValidationRule, parse, validate
from strawberry.extensions import FieldExtension, SchemaExtension
from strawberry.schema.schema import validate_document
from strawberry.types.graphql import OperationType

from app.core.errors import AppError
from app.core.logging import get_logger
from app.graphql.context import Context, sign_in

log = get_logger(__name__)


class Offload(FieldExtension):
    """On each root field and mutation (where the database work is): run it on the thread
    pool, through the context's lock (app/graphql/context.py), not on the event loop. A field
    extension on those fields only: a schema extension's `resolve` would wrap every field of
    the answer (thousands in the fleet view) for nothing."""

    def resolve(self, next_: Any, source: Any, info: Any, **kwargs: Any) -> Any:
        context = info.context
        if not isinstance(context, Context):
            return next_(source, info, **kwargs)
        return context.run(lambda: next_(source, info, **kwargs))


def offloaded(*types: Any) -> None:
    """`Offload` on the synchronous root fields of `types` (once each)."""
    for t in types:
        for f in t.__strawberry_definition__.fields:
            if f.base_resolver is not None and not f.is_async:
                if not any(isinstance(x, Offload) for x in f.extensions):
                    f.extensions.append(Offload())


class PerOperation(SchemaExtension):
    """What each operation starts afresh. On a websocket (one context for many operations):
    the key checked again, as a REST request would check it (revoked, expired, tenant
    suspended: refused from then on), a token of the caller's rate limit taken, and loaders
    that cache nothing from an earlier operation."""

    async def on_execute(self):  # type: ignore[override]
        context = self.execution_context.context
        cred = getattr(context, "_ws_cred", None)
        if isinstance(context, Context) and cred is not None:
            context.fresh_loaders()
            kind = self.execution_context.operation_type
            await sign_in(
                context,
                cred,
                context.ws_scope,
                "write" if kind is OperationType.MUTATION else "read",
            )
        yield


class CloseSession(SchemaExtension):
    """A mutation commits (and closes) the request's session where it runs; anything read after
    it opens a new transaction, which ends with the operation."""

    async def on_operation(self):  # type: ignore[override]
        yield
        context = self.execution_context.context
        if isinstance(context, Context):
            await context.run(context.session.close)


def masked(error: GraphQLError) -> bool:
    if isinstance(error.original_error, AppError) or (error.extensions or {}).get("code"):
        return False
    if error.original_error is None:  # a validation error of the query itself: shown
        return False
    # The request's own errors (variables that do not coerce, a scalar's value refused): no
    # path, or a GraphQLError underneath. Shown, with a code (app/graphql/limits.py).
    if error.path is None or isinstance(error.original_error, GraphQLError | ValueError):
        return False
    log.error("graphql_internal_error", error=repr(error.original_error), path=error.path)
    return True


QUERIES_KEPT = 256  # query texts whose parse and validation are kept (LRU, per process)
_parse = lru_cache(maxsize=QUERIES_KEPT)(parse)
_valid: OrderedDict[tuple[Any, str, tuple[type, ...]], None] = OrderedDict()


class CachedParse(SchemaExtension):
    """A query text's syntax tree, parsed once and shared (it is only read). A text that does
    not parse is left to Strawberry, which answers it as it always has."""

    def on_parse(self):  # type: ignore[override]
        ec = self.execution_context
        if ec.query:
            try:
                ec.graphql_document = _parse(ec.query, **ec.parse_options)
            except Exception:  # noqa: BLE001 (parsed again, and refused, by Strawberry)
                pass
        yield


class CachedValidation(SchemaExtension):
    """A query is validated once per text for what depends on its text alone (GraphQL's rules,
    depth, aliases), kept for the next time the same text comes (the portal sends the same few
    queries); the rules that depend on the request (`per_request`: the cost, with its
    variables; who asks, for introspection; the expensive fields' rate-limit tokens) run every
    time. Only a valid text is kept: errors are made afresh. With `CachedParse`, a query seen
    before builds no syntax tree and no validation visitors, which were most of a request's
    cyclic garbage (freed only by full collections: the dashboard's p99)."""

    def __init__(self, per_request: tuple[type[ValidationRule], ...]) -> None:
        super().__init__()
        self.per_request = per_request

    def on_validate(self):  # type: ignore[override]
        ec = self.execution_context
        schema, document = ec.schema._schema, ec.graphql_document
        assert document is not None
        rules = ec.validation_rules
        by_text = tuple(r for r in rules if r not in self.per_request)
        key = (schema, ec.query, by_text) if ec.query is not None else None
        errors: list[GraphQLError] = []
        if key is not None and key in _valid:
            _valid.move_to_end(key)
        else:
            errors = list(validate_document(schema, document, by_text))
            if key is not None and not errors:
                _valid[key] = None
                while len(_valid) > QUERIES_KEPT:
                    _valid.popitem(last=False)
        dynamic = [r for r in rules if r in self.per_request]
        if dynamic:
            errors += validate(schema, document, dynamic)
        ec.pre_execution_errors = errors
        yield
