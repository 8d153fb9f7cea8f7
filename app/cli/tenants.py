"""`rackplane tenants ...`: onboard tenants."""

from __future__ import annotations

import typer
from pydantic import ValidationError
from rich.table import Table
from sqlalchemy import select

from app.cli.common import console, fail
from app.core.db import session_scope
from app.core.errors import AppError
from app.keys.service import create_key
from app.models.tenants import Tenant
from app.tenants.schemas import TenantCreate
from app.tenants.service import approve, create_tenant

tenants_cli = typer.Typer(help="Onboard tenants.", no_args_is_help=True)


@tenants_cli.command("create")
def tenants_create(
    name: str = typer.Option(...),
    slug: str = typer.Option(...),
    email: str = typer.Option(...),
    policy: list[str] | None = typer.Option(None, help="Allowed isolation tier (repeat)."),
    with_key: bool = typer.Option(True, help="Also create an admin key and print it."),
) -> None:
    """Create an active tenant (and its first admin key)."""
    try:
        body = TenantCreate(name=name, slug=slug, contact_email=email, isolation_policy=policy)
    except ValidationError as exc:
        fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()), 2)
    try:
        with session_scope() as session:
            tenant = create_tenant(
                session,
                name=body.name,
                slug=body.slug,
                contact_email=body.contact_email,
                isolation_policy=body.isolation_policy,
            )
            key = (
                create_key(
                    session, tenant_id=tenant.id, name="initial", scopes=["read", "write", "admin"]
                )
                if with_key
                else None
            )
            tid = tenant.id
    except AppError as exc:
        fail(exc.detail, 2)
    console.print(f"tenant {slug} created: {tid}")
    if key:
        console.print(f"admin key (shown once): {key.key}")


@tenants_cli.command("list")
def tenants_list() -> None:
    table = Table("slug", "name", "status", "id")
    with session_scope() as session:
        for t in session.scalars(select(Tenant).order_by(Tenant.slug)):
            table.add_row(t.slug, t.name, t.status, str(t.id))
    console.print(table)


@tenants_cli.command("approve")
def tenants_approve(slug: str) -> None:
    """Approve a tenant that signed up itself."""
    try:
        with session_scope() as session:
            tenant = session.scalar(select(Tenant).where(Tenant.slug == slug))
            if tenant is None:
                fail(f"no tenant {slug}", 2)
            approve(tenant)
    except AppError as exc:
        fail(exc.detail, 2)
    console.print(f"tenant {slug} is active")
