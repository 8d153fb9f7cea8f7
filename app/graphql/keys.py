"""API keys: the caller's keys, creating one (its secret in that answer only) and revoking one.
The same service calls as REST's /v1/keys routes. SSH keys: the caller's, adding one (refused
with REST's codes: `ssh_key_is_private`, `ssh_key_too_weak` ...) and deleting one, as REST's
/v1/ssh-keys routes. Secrets: the caller's (never a value), setting one and deleting one, as
REST's /v1/secrets routes."""

from __future__ import annotations

import strawberry

from app.core.schemas import paginate
from app.graphql.context import Info
from app.graphql.pagination import Connection, connection, page_params
from app.graphql.permissions import TenantRead
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.keys import ssh_keys as ssh_service
from app.keys import tenant_secrets
from app.keys.schemas import (
    KeyCreate,
    KeyCreated,
    KeyOut,
    SecretOut,
    SecretSet,
    SshKeyCreate,
    SshKeyOut,
)
from app.keys.service import create_key, revoke
from app.models.keys import ApiKey as Row
from app.tenancy.principal import require_tenant_scope
from app.tenancy.scoping import get_owned, scoped_select

ApiKey = view(KeyOut, "ApiKey", "An API key (its secret is shown only when it is created)")
NewApiKey = view(KeyCreated, "NewApiKey", "A new API key: `key` is its secret, shown only now")
KeyInput = input_view(KeyCreate, "ApiKeyInput")
NewApiKeyResult = result_union("NewApiKeyResult", NewApiKey)
ApiKeyResult = result_union("ApiKeyResult", ApiKey)
SshKey = view(SshKeyOut, "SshKey", "An SSH public key, put on the instances you launch")
SshKeyInput = input_view(SshKeyCreate, "SshKeyInput")
SshKeyResult = result_union("SshKeyResult", SshKey)
Secret = view(SecretOut, "Secret", "A secret of yours: its name and size, never its value")
SecretInput = input_view(SecretSet, "SecretInput")
SecretResult = result_union("SecretResult", Secret)


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

    @strawberry.field(
        permission_classes=[TenantRead], description="Your SSH keys (REST: GET /v1/ssh-keys)"
    )
    def ssh_keys(self, info: Info, first: int = 50, after: str | None = None) -> Connection[SshKey]:  # type: ignore[valid-type]
        rows, nxt = ssh_service.list_ssh_keys(
            info.context.session, info.context.auth, page_params(first, after)
        )
        return connection(rows, lambda r: shape(SshKeyOut, r), nxt)

    @strawberry.field(
        permission_classes=[TenantRead],
        description="Your secrets, without their values (REST: GET /v1/secrets)",
    )
    def secrets(self, info: Info, first: int = 50, after: str | None = None) -> Connection[Secret]:  # type: ignore[valid-type]
        rows, nxt = tenant_secrets.list_secrets(
            info.context.session, info.context.auth, page_params(first, after)
        )
        return connection(rows, lambda r: shape(SecretOut, r), nxt)


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

    @strawberry.mutation(
        description="Add an SSH public key (REST: POST /v1/ssh-keys); a private key is refused "
        "(`ssh_key_is_private`) and never stored"
    )
    def add_ssh_key(self, info: Info, input: SshKeyInput) -> SshKeyResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(SshKeyCreate, input)
            key = ssh_service.add_ssh_key(
                ctx.session,
                tenant_id=ctx.auth.tenant_id,
                name=body.name,
                public_key=body.public_key,
            )
            # The audit's parameters: never the body (its text may be a refused private key).
            return {}, key, shape(SshKeyOut, key)

        return run_mutation(info, "addSshKey", act)

    @strawberry.mutation(
        description="Delete an SSH key (REST: DELETE /v1/ssh-keys/{id}); answers it as it was"
    )
    def delete_ssh_key(self, info: Info, id: strawberry.ID) -> SshKeyResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            key = ssh_service.get_ssh_key(ctx.session, ctx.auth, str(id), for_update=True)
            answer = shape(SshKeyOut, key)
            ssh_service.delete_ssh_key(ctx.session, key)
            return {"ssh_key_id": str(id)}, key, answer

        return run_mutation(info, "deleteSshKey", act)

    @strawberry.mutation(
        description="Set a secret's value (REST: PUT /v1/secrets/{name}); the answer, as every "
        "read, shows its size and version, never the value"
    )
    def put_secret(self, info: Info, input: SecretInput) -> SecretResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(SecretSet, input)
            row, _ = tenant_secrets.put_secret(
                ctx.session, ctx.auth.tenant_id, body.name, body.value
            )
            # The audit's parameters: the name, never the value.
            return {"name": body.name}, row, shape(SecretOut, row)

        return run_mutation(info, "putSecret", act)

    @strawberry.mutation(
        description="Delete a secret (REST: DELETE /v1/secrets/{name}); `secret_in_use` while a "
        "workload that has not ended names it"
    )
    def delete_secret(self, info: Info, name: str) -> SecretResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            row = tenant_secrets.delete_secret(ctx.session, ctx.auth, name)
            return {"name": name}, row, shape(SecretOut, row)

        return run_mutation(info, "deleteSecret", act)
