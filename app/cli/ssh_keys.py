"""`rackplane ssh-keys ...`: a tenant's SSH public keys (the service REST and GraphQL call)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from app.cli.common import console, every_page, fail, tenant_id
from app.core.db import session_scope
from app.core.errors import AppError
from app.keys.schemas import SshKeyCreate, SshKeyOut
from app.keys.ssh import looks_private, parse_public_key
from app.keys.ssh_keys import add_ssh_key, delete_ssh_key, list_ssh_keys, ssh_key_named

ssh_keys_cli = typer.Typer(help="Add, list and delete a tenant's SSH keys.", no_args_is_help=True)
MAX_FILE = 16384  # as the API's `public_key`


@ssh_keys_cli.command("add")
def ssh_keys_add(
    tenant: str = typer.Option(..., help="Tenant slug."),
    name: str = typer.Option(..., help="Unique in the tenant: letters, digits, . _ - (1-63)."),
    public_key_file: Path = typer.Option(
        ..., help="The public key file (e.g. ~/.ssh/id_ed25519.pub).", dir_okay=False
    ),
) -> None:
    """Add an SSH public key to a tenant (ed25519, ECDSA, RSA of 3072 bits or more)."""
    try:
        with public_key_file.open("rb") as f:
            text = f.read(MAX_FILE + 1).decode("utf-8", "replace")
    except OSError as e:
        fail(escape(f"cannot read {public_key_file}: {e.strerror}"), 2)
    try:
        if looks_private(text):
            parse_public_key(text)  # refused, saying so (and never printed)
        body = SshKeyCreate.model_validate({"name": name, "public_key": text})  # REST's rules
    except AppError as e:
        fail(escape(f"{e.detail} ({e.code})"), 2)
    except ValidationError as e:
        fail(
            escape("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())), 2
        )
    with session_scope() as session:
        owner = tenant_id(session, tenant)
        try:
            key = add_ssh_key(session, tenant_id=owner, name=body.name, public_key=body.public_key)
        except AppError as e:  # its words and code, never the file's text
            fail(escape(f"{e.detail} ({e.code})"), 2)
        out = SshKeyOut.model_validate(key)
    console.print(f"ssh key {out.name} added: {out.key_type} {out.bits} {out.fingerprint}")


@ssh_keys_cli.command("list")
def ssh_keys_list(
    tenant: str = typer.Option(..., help="Tenant slug."),
    as_json: bool = typer.Option(False, "--json", help="The API's documents."),
) -> None:
    """A tenant's SSH keys, oldest first."""
    with session_scope() as session:
        owner = tenant_id(session, tenant)
        got = every_page(lambda page: list_ssh_keys(session, owner, page))
        rows = [SshKeyOut.model_validate(r) for r in got]
    if as_json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table("NAME", "TYPE", "BITS", "FINGERPRINT", "COMMENT", "ADDED")
    for r in rows:
        table.add_row(
            r.name,
            r.key_type,
            str(r.bits),
            r.fingerprint,
            escape(r.comment or ""),
            r.created_at.isoformat(),
        )
    console.print(table)


@ssh_keys_cli.command("delete")
def ssh_keys_delete(
    name: str = typer.Argument(..., help="The key's name."),
    tenant: str = typer.Option(..., help="Tenant slug."),
) -> None:
    """Delete a tenant's SSH key by its name."""
    with session_scope() as session:
        key = ssh_key_named(session, tenant_id(session, tenant), name)
        if key is None:
            fail(escape(f"{tenant} has no ssh key named {name}"), 2)
        delete_ssh_key(session, key)
    console.print(f"ssh key {name} deleted")
