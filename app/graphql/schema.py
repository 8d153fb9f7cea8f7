"""The schema: queries over the same services and tenancy scoping as REST, limits checked
before execution, internal errors masked, and errors carrying REST's stable codes.

Each domain's module (app/graphql/workloads.py, fleet.py, ...) declares its types, its query
fields and its mutations; `Query` and `Mutation` gather them, their fields in the order of
`QUERY_FIELDS` and `MUTATION_FIELDS` (the published order, sdl/schema.graphql), whichever
module declares each."""

from __future__ import annotations

import json
from collections import Counter
from itertools import chain
from typing import Any

import strawberry
from cross_web import HTTPException
from graphql import GraphQLError
from strawberry.extensions import (
    AddValidationRules,
    DisableIntrospection,
    MaskErrors,
    MaxTokensLimiter,
)
from strawberry.fastapi import GraphQLRouter
from strawberry.schema.config import StrawberryConfig
from strawberry.types.unset import UNSET
from strawberry.utils.str_converters import to_camel_case

from app.core.config import get_settings
from app.core.errors import AppError
from app.core.routing import REPLAY, stored_response
from app.graphql import subscriptions
from app.graphql.billing import BillingMutation, BillingQuery
from app.graphql.chaos import ChaosMutation, ChaosQuery
from app.graphql.context import Context, get_context
from app.graphql.endpoints import EndpointMutation, EndpointQuery
from app.graphql.extensions import (
    CachedParse,
    CachedValidation,
    CloseSession,
    PerOperation,
    masked,
    offloaded,
)
from app.graphql.fleet import FleetMutation, FleetQuery
from app.graphql.health import HealthMutation, HealthQuery
from app.graphql.keys import KeyMutation, KeyQuery
from app.graphql.limits import (
    MAX_JSON_DEPTH,
    ExpensiveFields,
    Introspection,
    LimitCodes,
    TooDeep,
    Variables,
    alias_rule,
    cost_rule,
    depth_rule,
    load_body,
)
from app.graphql.logs import LogSubscription
from app.graphql.metering import MeteringQuery
from app.graphql.quotas import QuotaMutation, QuotaQuery
from app.graphql.stacks import StackMutation, StackQuery
from app.graphql.tenants import TenantMutation, TenantQuery
from app.graphql.upgrades import UpgradeMutation, UpgradeQuery
from app.graphql.views import BIG_INT, BigInt
from app.graphql.volumes import VolumeMutation, VolumeQuery
from app.graphql.workloads import WorkloadMutation, WorkloadQuery

QUERIES = (
    TenantQuery,
    WorkloadQuery,
    FleetQuery,
    KeyQuery,
    QuotaQuery,
    MeteringQuery,
    BillingQuery,
    HealthQuery,
    ChaosQuery,
    StackQuery,
    UpgradeQuery,
    VolumeQuery,
    EndpointQuery,
)
MUTATIONS = (
    WorkloadMutation,
    KeyMutation,
    BillingMutation,
    FleetMutation,
    QuotaMutation,
    TenantMutation,
    HealthMutation,
    ChaosMutation,
    StackMutation,
    UpgradeMutation,
    VolumeMutation,
    EndpointMutation,
)
# The root fields' order in the SDL (GraphQL names), as published: by when each was added.
QUERY_FIELDS = (
    "viewer workloads nodes workload apiKeys quotas capacity usage bill upcomingBill budget "
    "commitments prices dryRun regions racks tenants tenantQuotas utilisation idleTime "
    "fleetHealth fleetMap fleetImport reconciliation tenant chaosExperiments chaosExperiment "
    "softwareStacks upgrades upgrade bringUp sshKeys secrets volumes endpoints endpoint "
    "endpointEvents"
).split()
MUTATION_FIELDS = (
    "submitWorkload terminateWorkload reportCheckpoint requestCheckpoint createApiKey "
    "revokeApiKey setBudget removeBudget setNodeState setTenantQuotas approveTenant "
    "suspendTenant reactivateTenant updateTenant createPrice setNodeHealth setGpuHealth "
    "stopChaosExperiment createStack assignStack startUpgrade resumeUpgrade rollbackUpgrade "
    "setMigLayout addSshKey deleteSshKey putSecret deleteSecret putVolume deleteVolume "
    "createEndpoint updateEndpoint deleteEndpoint"
).split()
SUBSCRIPTION_FIELDS = "workloadEvents fleetChanges workloadLogs".split()


def _graphql_name(field: Any) -> str:
    return field.graphql_name or to_camel_case(field.python_name)


def in_order(name: str, parts: tuple[type, ...], order: list[str]) -> type:
    """One root type (`Query`, `Mutation`) of the domains' `parts`, its fields in `order`
    (GraphQL names). Each field is declared once and listed once: a field missing from the
    order, listed but declared nowhere, or declared twice is an error here, not a schema that
    silently drops or reorders it."""
    declared = Counter(
        _graphql_name(f) for f in chain(*(p.__strawberry_definition__.fields for p in parts))
    )
    if declared != Counter(order):
        odd = sorted(n for n in declared | Counter(order) if declared[n] != order.count(n))
        raise TypeError(f"{name}: fields not declared once and listed once: {odd}")
    merged = strawberry.type(type(name, parts, {}))
    rank = {field: i for i, field in enumerate(order)}
    merged.__strawberry_definition__.fields.sort(key=lambda f: rank[_graphql_name(f)])
    return merged


Query = in_order("Query", QUERIES, QUERY_FIELDS)
Mutation = in_order("Mutation", MUTATIONS, MUTATION_FIELDS)
Subscription = in_order(
    "Subscription", (subscriptions.Subscription, LogSubscription), SUBSCRIPTION_FIELDS
)


class Schema(strawberry.Schema):
    def process_errors(self, errors: list[GraphQLError], execution_context: Any = None) -> None:
        """Errors with a code are answers, not incidents; internal ones are logged (with the
        request id) where they are masked."""


def build_schema() -> strawberry.Schema:
    s = get_settings()
    # The limits' validation rules, built once: a limiter makes a class each time it is made.
    by_text = [
        depth_rule(s.graphql_max_depth),
        alias_rule(s.graphql_max_aliases),
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
        lambda: MaskErrors(should_mask_error=masked, error_message="Internal error"),
    ]
    if not s.graphql_introspection:
        extensions.append(DisableIntrospection)
    offloaded(Query, Mutation)
    return Schema(
        query=Query,
        mutation=Mutation,
        subscription=Subscription,
        extensions=extensions,
        config=StrawberryConfig(scalar_map={BigInt: BIG_INT}),
    )


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
        # The connection_init payload's key (app/graphql/subscriptions.py).
        return await subscriptions.on_ws_connect(context)


def router() -> GraphQLRouter:
    return Router(
        schema,
        context_getter=get_context,
        graphql_ide="graphiql" if get_settings().is_sqlite else None,
    )
