"""`rackplane volumes ...`: a tenant's volumes (the service REST and GraphQL call): named
directories its runs mount, on each node's disk or on the fleet's shared storage."""

from __future__ import annotations

import json

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from app.cli.common import console, every_page, fail, tenant_id
from app.core.db import session_scope
from app.core.errors import AppError
from app.workloads.replies import VolumeOut
from app.workloads.schemas import VolumeSet
from app.workloads.volumes import delete_volume, list_volumes, put_volume

volumes_cli = typer.Typer(
    help="Make, list and delete a tenant's volumes (directories its runs mount).",
    no_args_is_help=True,
)


@volumes_cli.command("create")
def volumes_create(
    name: str = typer.Argument(..., help="Unique in the tenant: letters, digits, . _ - (1-63)."),
    tenant: str = typer.Option(..., help="Tenant slug."),
    storage: str = typer.Option(
        "node", help="node (each node's own disk) or shared (the fleet's shared storage)."
    ),
) -> None:
    """Make a volume (or say it is there already)."""
    try:
        body = VolumeSet.model_validate({"name": name, "storage": storage})  # REST's rules
    except ValidationError as e:
        fail(
            escape("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())),
            2,
        )
    with session_scope() as session:
        try:
            row, created = put_volume(session, tenant_id(session, tenant), body.name, body.storage)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
        out = VolumeOut.model_validate(row)
    console.print(
        f"volume {out.name} ({out.storage} storage) {'made' if created else 'already there'}"
    )


@volumes_cli.command("list")
def volumes_list(
    tenant: str = typer.Option(..., help="Tenant slug."),
    as_json: bool = typer.Option(False, "--json", help="The API's documents."),
) -> None:
    """A tenant's volumes, oldest first."""
    with session_scope() as session:
        owner = tenant_id(session, tenant)
        rows = [VolumeOut.model_validate(r) for r in every_page(
            lambda page: list_volumes(session, owner, page)
        )]  # fmt: skip
    if as_json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table("NAME", "STORAGE", "ID", "MADE")
    for r in rows:
        table.add_row(r.name, r.storage, str(r.id), r.created_at.isoformat())
    console.print(table)


@volumes_cli.command("delete")
def volumes_delete(
    name: str = typer.Argument(..., help="The volume's name."),
    tenant: str = typer.Option(..., help="Tenant slug."),
) -> None:
    """Delete a tenant's volume (refused while a workload that has not ended mounts it)."""
    with session_scope() as session:
        try:
            delete_volume(session, tenant_id(session, tenant), name)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
    console.print(f"volume {name} deleted")
