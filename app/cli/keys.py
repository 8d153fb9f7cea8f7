"""`rackplane keys ...`: create and revoke API keys."""

from __future__ import annotations

import typer
from sqlalchemy import select

from app.cli.common import console, fail
from app.core.db import session_scope
from app.keys.service import create_key, revoke
from app.models.keys import ApiKey
from app.models.tenants import Tenant
from app.tenancy.principal import TENANT_SCOPES

keys_cli = typer.Typer(help="Create and revoke API keys.", no_args_is_help=True)


@keys_cli.command("create")
def keys_create(
    tenant: str | None = typer.Option(None, help="Tenant slug."),
    platform: bool = typer.Option(False, "--platform", help="An operator key."),
    name: str = typer.Option("cli"),
    scope: list[str] | None = typer.Option(
        None, help="read, write, admin or invoke (repeat; invoke: call endpoints only)."
    ),
) -> None:
    """Create an API key and print it (once)."""
    if platform == bool(tenant):
        fail("give either --tenant SLUG or --platform", 2)
    scopes = ["platform"] if platform else list(dict.fromkeys(scope or ["read", "write"]))
    if not platform and not set(scopes) <= set(TENANT_SCOPES):
        fail("tenant key scopes are read, write, admin and invoke", 2)
    with session_scope() as session:
        tenant_id = None
        if tenant:
            tenant_id = session.scalar(select(Tenant.id).where(Tenant.slug == tenant))
            if tenant_id is None:
                fail(f"no tenant {tenant}", 2)
        key = create_key(session, tenant_id=tenant_id, name=name, scopes=scopes)
    console.print(f"key {key.prefix} ({', '.join(scopes)}), shown once:\n{key.key}")


@keys_cli.command("revoke")
def keys_revoke(prefix: str) -> None:
    """Revoke a key by its public prefix (the 8 characters after `rp_`)."""
    with session_scope() as session:
        key = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
        if key is None:
            fail(f"no key with prefix {prefix}", 2)
        revoke(key)
    console.print(f"key {prefix} revoked")
