"""`rackplane secrets ...`: a tenant's secrets (the service REST and GraphQL call). A value is
read from a file or standard input, never from the command line (any user of the host may read
a process's arguments), and never printed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from app.cli.common import console, every_page, fail, tenant_id
from app.core.db import session_scope
from app.core.errors import AppError
from app.keys.schemas import MAX_SECRET_BYTES, SecretOut, SecretSet
from app.keys.tenant_secrets import delete_secret, list_secrets, put_secret

secrets_cli = typer.Typer(
    help="Set, list and delete a tenant's secrets (values go in, never out).",
    no_args_is_help=True,
)


@secrets_cli.command("set")
def secrets_set(
    name: str = typer.Argument(..., help="Unique in the tenant: letters, digits, . _ - (1-63)."),
    tenant: str = typer.Option(..., help="Tenant slug."),
    from_file: Path | None = typer.Option(
        None,
        "--from-file",
        help="Read the value from this file (default: standard input).",
        dir_okay=False,
    ),
) -> None:
    """Set a secret's value (a new secret, or a new version: runs that start later get it). A
    trailing line break of the input is dropped."""
    try:
        if from_file is not None:
            raw = from_file.read_bytes()[: MAX_SECRET_BYTES * 4 + 1]
        else:
            raw = sys.stdin.buffer.read(MAX_SECRET_BYTES * 4 + 1)
    except OSError as e:
        fail(escape(f"cannot read {from_file}: {e.strerror}"), 2)
    try:
        value = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        fail("the value is not UTF-8 text (a secret is given to a process as an env value)", 2)
    try:
        body = SecretSet.model_validate({"name": name, "value": value})  # REST's rules
    except ValidationError as e:
        fail(
            escape("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())),
            2,
        )
    with session_scope() as session:
        try:
            row, created = put_secret(session, tenant_id(session, tenant), body.name, body.value)
        except AppError as e:  # its words and code, never the value
            fail(escape(f"{e.detail} ({e.code})"), 2)
        out = SecretOut.model_validate(row)
    console.print(
        f"secret {out.name} {'set' if created else 'replaced'}: {out.size} bytes, "
        f"version {out.version}"
    )


@secrets_cli.command("list")
def secrets_list(
    tenant: str = typer.Option(..., help="Tenant slug."),
    as_json: bool = typer.Option(False, "--json", help="The API's documents."),
) -> None:
    """A tenant's secrets (names, sizes and versions), oldest first."""
    with session_scope() as session:
        owner = tenant_id(session, tenant)
        got = every_page(lambda page: list_secrets(session, owner, page))
        rows = [SecretOut.model_validate(r) for r in got]
    if as_json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table("NAME", "BYTES", "VERSION", "UPDATED")
    for r in rows:
        table.add_row(r.name, str(r.size), str(r.version), r.updated_at.isoformat())
    console.print(table)


@secrets_cli.command("delete")
def secrets_delete(
    name: str = typer.Argument(..., help="The secret's name."),
    tenant: str = typer.Option(..., help="Tenant slug."),
) -> None:
    """Delete a tenant's secret (refused while a workload that has not ended names it)."""
    with session_scope() as session:
        try:
            delete_secret(session, tenant_id(session, tenant), name)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
    console.print(f"secret {name} deleted")
