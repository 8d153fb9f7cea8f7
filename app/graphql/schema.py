"""The schema: queries over the same services and tenancy scoping as REST, limits checked
before execution, internal errors masked, and errors carrying REST's stable codes."""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from functools import lru_cache
from typing import Annotated, Any

import strawberry
from cross_web import HTTPException
from graphql import GraphQLError, ValidationRule, parse, validate
from strawberry.extensions import (
    AddValidationRules,
    FieldExtension,
    MaskErrors,
    MaxAliasesLimiter,
    MaxTokensLimiter,
    QueryDepthLimiter,
    SchemaExtension,
)
from strawberry.fastapi import GraphQLRouter
from strawberry.scalars import JSON
from strawberry.schema.config import StrawberryConfig
from strawberry.schema.schema import validate_document
from strawberry.tools import merge_types
from strawberry.types.nodes import SelectedField
from strawberry.types.unset import UNSET

from app.core.config import get_settings
from app.core.errors import AppError, NotFound, ValidationFailed
from app.core.logging import get_logger
from app.core.routing import REPLAY, stored_response
from app.fleet.service import list_nodes
from app.graphql.account import AccountQuery, page_params
from app.graphql.context import Context, get_context
from app.graphql.dataloaders.events import newest as newest_events
from app.graphql.limits import (
    MAX_JSON_DEPTH,
    ExpensiveFields,
    Introspection,
    LimitCodes,
    TooDeep,
    Variables,
    cost_rule,
    load_body,
)
from app.graphql.operator import OperatorQuery
from app.graphql.permissions import IsOperator, TenantRead, TenantReadAnyStatus
from app.graphql.types import (
    Node,
    NodeConnection,
    NodeEdge,
    PageInfo,
    Viewer,
    Workload,
    WorkloadConnection,
    WorkloadEdge,
    edge_cursor,
    node_id,
)
from app.graphql.views import BIG_INT, BigInt, text_args
from app.models.tenants import Tenant
from app.models.workloads import Workload as Row
from app.scheduling.lifecycle import State
from app.tenancy.scoping import get_owned
from app.workloads import service

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


def _offloaded(*types: Any) -> None:
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
        from strawberry.types.graphql import OperationType

        context = self.execution_context.context
        cred = getattr(context, "_ws_cred", None)
        if isinstance(context, Context) and cred is not None:
            from app.graphql.subscriptions import sign_in

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


def _masked(error: GraphQLError) -> bool:
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


PRIORITIES = ("production", "training", "research", "preemptible")


def _selects(selections: list[Any], *path: str) -> bool:
    """Whether `selections` (through fragments) ask for the field at `path` (its GraphQL
    names, e.g. `edges`, `node`, `events`)."""
    head, *rest = path
    for sel in selections:
        if isinstance(sel, SelectedField):
            if sel.name == head and (not rest or _selects(sel.selections, *rest)):
                return True
        elif _selects(sel.selections, *path):  # a fragment's fields are its parent's
            return True
    return False


@strawberry.type
class CoreQuery:
    @strawberry.field(permission_classes=[TenantReadAnyStatus], description="The calling tenant")
    def viewer(self, info: strawberry.Info[Context, None]) -> Viewer:
        auth = info.context.auth
        t = info.context.session.get(Tenant, auth.tenant_id)
        if t is None:
            raise NotFound("The key's tenant is gone.")
        return Viewer(
            id=strawberry.ID(str(t.id)),
            slug=t.slug,
            name=t.name,
            status=t.status,
            isolation_policy=list(t.isolation_policy or []),
        )

    @strawberry.field(
        permission_classes=[TenantRead], description="The caller's workloads, oldest first"
    )
    def workloads(
        self,
        info: strawberry.Info[Context, None],
        first: int = 50,
        after: str | None = None,
        state: str | None = None,
        kind: str | None = None,
        priority: str | None = None,
        labels: JSON | None = strawberry.UNSET,
        active: Annotated[
            bool | None,
            strawberry.argument(
                description="true: not yet ended (queued to running); false: ended"
            ),
        ] = None,
    ) -> WorkloadConnection:
        auth = info.context.auth
        page = page_params(first, after)
        try:
            st = State(state) if state is not None else None
        except ValueError:
            raise ValidationFailed(
                f"No workload state {state!r}.", code="validation_error"
            ) from None
        if kind is not None and kind not in ("instance", "vm", "job"):
            raise ValidationFailed(f"No workload kind {kind!r}.", code="validation_error")
        if priority is not None and priority not in PRIORITIES:
            raise ValidationFailed(f"No priority {priority!r}.", code="validation_error")
        if labels and (
            not isinstance(labels, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        ):
            raise ValidationFailed(
                "labels is an object of strings: {key: value}.", code="validation_error"
            )
        text_args(labels=labels or None)
        rows, nxt = service.list_workloads(
            info.context.session,
            auth,
            page,
            state=st,
            active=active,
            kind=kind,
            priority=priority,
            labels=labels or None,
        )
        # Their events, when asked for, in the same thread hop: one statement for the page,
        # handed to each workload (no loader, no awaitable per workload).
        events = None
        if rows and any(
            _selects(f.selections, "edges", "node", "events") for f in info.selected_fields
        ):
            events = newest_events(info.context.session, info.context.auth, [w.id for w in rows])
        return WorkloadConnection(
            edges=[
                WorkloadEdge(
                    cursor=edge_cursor(w),
                    node=Workload.of(w, None if events is None else events.get(w.id, [])),
                )
                for w in rows
            ],
            page_info=PageInfo(has_next_page=nxt is not None, end_cursor=nxt),
        )

    @strawberry.field(
        permission_classes=[IsOperator], description="Operators: the fleet's nodes, oldest first"
    )
    def nodes(
        self,
        info: strawberry.Info[Context, None],
        first: int = 50,
        after: str | None = None,
        state: str | None = None,
        gpu_model: str | None = None,
        name: str | None = None,
    ) -> NodeConnection:
        page = page_params(first, after)
        text_args(state=state, gpu_model=gpu_model, name=name)
        rows, nxt = list_nodes(
            info.context.session,
            page,
            state=state,
            gpu_model=gpu_model,
            name=name,
        )
        return NodeConnection(
            edges=[NodeEdge(cursor=edge_cursor(n), node=Node.of(n)) for n in rows],
            page_info=PageInfo(has_next_page=nxt is not None, end_cursor=nxt),
        )

    @strawberry.field(permission_classes=[TenantRead], description="One of the caller's workloads")
    def workload(self, info: strawberry.Info[Context, None], id: strawberry.ID) -> Workload:
        auth = info.context.auth
        wid: uuid.UUID | None = node_id(str(id))
        if wid is None:
            raise NotFound(f"No workload with id {id}.", code="workload_not_found")
        return Workload.of(get_owned(info.context.session, auth, Row, str(wid), what="workload"))


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


class Schema(strawberry.Schema):
    def process_errors(self, errors: list[GraphQLError], execution_context: Any = None) -> None:
        """Errors with a code are answers, not incidents; internal ones are logged (with the
        request id) where they are masked."""


def build_schema() -> strawberry.Schema:
    s = get_settings()
    # The limits' validation rules, built once: a limiter makes a class each time it is made.
    by_text = [
        *QueryDepthLimiter(max_depth=s.graphql_max_depth).validation_rules,
        *MaxAliasesLimiter(max_alias_count=s.graphql_max_aliases).validation_rules,
    ]
    per_request = (cost_rule(s.graphql_max_cost), Introspection, ExpensiveFields)
    # Factories: a fresh extension per request.
    extensions: list[Any] = [
        PerOperation,
        Variables,
        LimitCodes,
        CachedParse,
        lambda: AddValidationRules(by_text),
        lambda: AddValidationRules(list(per_request)),
        lambda: CachedValidation(per_request),
        lambda: MaxTokensLimiter(max_token_count=s.graphql_max_tokens),
        CloseSession,
        lambda: MaskErrors(should_mask_error=_masked, error_message="Internal error"),
    ]
    if not s.graphql_introspection:
        from strawberry.extensions import DisableIntrospection

        extensions.append(DisableIntrospection)
    from app.graphql.mutations import AccountMutation
    from app.graphql.operator import OperatorMutation
    from app.graphql.subscriptions import Subscription

    Mutation = merge_types("Mutation", (AccountMutation, OperatorMutation))
    _offloaded(Query, Mutation)
    return Schema(
        query=Query,
        mutation=Mutation,
        subscription=Subscription,
        extensions=extensions,
        config=StrawberryConfig(scalar_map={BigInt: BIG_INT}),
    )


Query = merge_types("Query", (CoreQuery, AccountQuery, OperatorQuery))


schema = build_schema()


class Router(GraphQLRouter):
    """Strawberry's router, and where an `Idempotency-Key` replay is handed back: the
    idempotency middleware claims the key and finds the first answer (app/idempotency), REST's
    routes replay it after their dependencies; here after the context authenticated the key.
    A mutation sent again with the same key is not run again."""

    async def run(self, request: Any, context: Any = UNSET, root_value: Any = UNSET) -> Any:
        replay = REPLAY.get()
        if replay is not None and isinstance(context, Context) and context._auth is not None:
            return stored_response(replay)
        try:
            return await super().run(request, context=context, root_value=root_value)
        except HTTPException as e:  # Strawberry's own refusals, as problem+json with a code
            if isinstance(e.__cause__, TooDeep):
                raise AppError(
                    f"The request nests deeper than {MAX_JSON_DEPTH} levels.",
                    code="json_too_deep",
                ) from e
            if isinstance(e.__cause__, json.JSONDecodeError):
                raise AppError("The request body is not valid JSON.", code="invalid_json") from e
            refusal = AppError(e.reason, code="bad_graphql_request")
            refusal.status = e.status_code
            raise refusal from e

    def decode_json(self, data: str | bytes) -> object:
        return load_body(data)

    async def on_ws_connect(self, context: Any) -> Any:
        from app.graphql.subscriptions import on_ws_connect  # the connection_init payload's key

        return await on_ws_connect(context)


def router() -> GraphQLRouter:
    return Router(
        schema,
        context_getter=get_context,
        graphql_ide="graphiql" if get_settings().is_sqlite else None,
    )
