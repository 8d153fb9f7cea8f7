"""API keys: the caller's keys, creating one (its secret in that answer only) and revoking one.
The same service calls as REST's /v1/keys routes."""

from __future__ import annotations

import strawberry

from app.core.schemas import paginate
from app.graphql.context import Info
from app.graphql.pagination import Connection, connection, page_params
from app.graphql.permissions import TenantRead
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.keys.schemas import KeyCreate, KeyCreated, KeyOut
from app.keys.service import create_key, revoke
from app.models.keys import ApiKey as Row
from app.tenancy.auth import require_tenant_scope
from app.tenancy.scoping import get_owned, scoped_select

ApiKey = view(KeyOut, "ApiKey", "An API key (its secret is shown only when it is created)")
NewApiKey = view(KeyCreated, "NewApiKey", "A new API key: `key` is its secret, shown only now")
KeyInput = input_view(KeyCreate, "ApiKeyInput")
NewApiKeyResult = result_union("NewApiKeyResult", NewApiKey)
ApiKeyResult = result_union("ApiKeyResult", ApiKey)


@strawberry.type
class KeyQuery:
    @strawberry.field(
        permission_classes=[TenantRead], description="Your API keys (REST: GET /v1/keys)"
    )
    def api_keys(self, info: Info, first: int = 50, after: str | None = None) -> Connection[ApiKey]:  # type: ignore[valid-type]
        auth = info.context.auth
        rows, nxt = paginate(
            info.context.session, scoped_select(auth, Row), Row, page_params(first, after)
        )
        return connection(rows, lambda r: shape(KeyOut, r), nxt)


@strawberry.type
class KeyMutation:
    @strawberry.mutation(description="Create an API key; its secret is in this answer only")
    def create_api_key(self, info: Info, input: KeyInput) -> NewApiKeyResult:  # type: ignore[valid-type]
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

        return run_mutation(info, "createApiKey", act)

    @strawberry.mutation(description="Revoke an API key (effective on its next request)")
    def revoke_api_key(self, info: Info, id: strawberry.ID) -> ApiKeyResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "admin")
            key = revoke(get_owned(ctx.session, ctx.auth, Row, str(id), what="key"))
            return {"key_id": str(id)}, key, shape(KeyOut, key)

        return run_mutation(info, "revokeApiKey", act)
