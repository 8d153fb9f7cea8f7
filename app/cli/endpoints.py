"""`rackplane endpoints ...`: a tenant's inference endpoints (the service REST and GraphQL
call): make one, list them, show one with its replicas and scaling decisions, change its
bounds, delete it."""

from __future__ import annotations

import json
import shlex
import uuid

import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from app.cli.common import console, every_page, fail, tenant_id
from app.core.db import session_scope
from app.core.errors import AppError
from app.endpoints import service
from app.endpoints.schemas import EndpointCreate, EndpointOut, EndpointPatch
from app.models.tenants import Tenant
from app.tenancy.principals import tenant_context

endpoints_cli = typer.Typer(
    help="Make, list, show, scale and delete a tenant's inference endpoints.",
    no_args_is_help=True,
)


def _acting(session, slug: str):
    """The tenant's own rights (its isolation policy, limits and budget), as its key has."""
    tenant = session.get(Tenant, tenant_id(session, slug))
    return tenant_context(session, tenant, uuid.UUID(int=0), "cli", ("read", "write"))


def _errors(e: ValidationError) -> str:
    return escape("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))


@endpoints_cli.command("create")
def endpoints_create(
    name: str = typer.Argument(..., help="Unique in the tenant: letters, digits, . _ - (1-63)."),
    tenant: str = typer.Option(..., help="Tenant slug."),
    command: str = typer.Option(None, help="What a replica runs (a shell-quoted line)."),
    image: str = typer.Option(None, help="A container image (with --runtime podman)."),
    runtime: str = typer.Option(None, help="process or podman."),
    gpus: int = typer.Option(0, help="Whole GPUs per replica."),
    mig_profile: str = typer.Option(None, help="A MIG profile per replica instead."),
    port: int = typer.Option(8000, help="The port a replica serves on (in its container)."),
    ready_path: str = typer.Option("/healthz", help="Ready once a GET of this answers 2xx."),
    min_replicas: int = typer.Option(0, "--min", help="Replicas kept when idle (0: to zero)."),
    max_replicas: int = typer.Option(1, "--max", help="Replicas it never exceeds."),
    p95_ms: int = typer.Option(None, help="SLO: a request's p95 latency."),
    ttft_ms: int = typer.Option(None, help="SLO: a stream's p95 time to first token."),
    signal: str = typer.Option("concurrency", help="concurrency or rps."),
    target: float = typer.Option(4.0, help="The signal's target per replica."),
) -> None:
    """Make an endpoint (its first --min replicas are submitted at once)."""
    replica = {
        k: v
        for k, v in {
            "command": shlex.split(command) if command else None,
            "image": image,
            "runtime": runtime,
            "gpus": gpus or None,
            "mig_profile": mig_profile,
        }.items()
        if v is not None
    }
    doc = {
        "name": name,
        "replica": replica,
        "port": port,
        "ready_path": ready_path,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "slo": {"p95_ms": p95_ms, "ttft_ms": ttft_ms} if p95_ms or ttft_ms else {"p95_ms": 1000},
        "scaling": {"signal": signal, "target": target},
    }
    try:
        body = EndpointCreate.model_validate(doc)  # REST's rules
    except ValidationError as e:
        fail(_errors(e), 2)
    with session_scope() as session:
        try:
            ep = service.create_endpoint(session, _acting(session, tenant), body)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
        out = EndpointOut.model_validate(service.endpoint_doc(ep, []))
    console.print(f"endpoint {out.name} made: /e/{out.name}/, {out.target} replica(s) to start")


@endpoints_cli.command("list")
def endpoints_list(
    tenant: str = typer.Option(..., help="Tenant slug."),
    as_json: bool = typer.Option(False, "--json", help="The API's documents."),
) -> None:
    """A tenant's endpoints, oldest first."""
    with session_scope() as session:
        owner = tenant_id(session, tenant)
        rows = every_page(lambda page: service.list_endpoints(session, owner, page))
        replicas = service.replicas_of(session, [r.id for r in rows])
        outs = [EndpointOut.model_validate(service.endpoint_doc(r, replicas[r.id])) for r in rows]
    if as_json:
        console.print_json(json.dumps([o.model_dump(mode="json") for o in outs]))
        return
    table = Table("NAME", "TARGET", "READY", "REPLICAS", "BOUNDS", "SIGNAL")
    for o in outs:
        table.add_row(
            o.name,
            str(o.target),
            str(sum(r.ready for r in o.replicas)),
            str(len(o.replicas)),
            f"{o.min_replicas}..{o.max_replicas}",
            f"{o.scaling.signal} {o.scaling.target:g}",
        )
    console.print(table)


@endpoints_cli.command("show")
def endpoints_show(
    name: str = typer.Argument(..., help="The endpoint's name."),
    tenant: str = typer.Option(..., help="Tenant slug."),
) -> None:
    """An endpoint: its replicas and its latest scaling decisions."""
    with session_scope() as session:
        owner = tenant_id(session, tenant)
        try:
            ep = service.get_endpoint(session, owner, name)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
        out = EndpointOut.model_validate(
            service.endpoint_doc(ep, service.replicas_of(session, [ep.id])[ep.id])
        )
        events = [(e.at, e.kind, e.target, e.reason) for e in service.events_of(
            session, owner, name, 10
        )]  # fmt: skip
    console.print(
        f"endpoint {out.name}: /e/{out.name}/ target {out.target} "
        f"(bounds {out.min_replicas}..{out.max_replicas})"
    )
    for r in out.replicas:
        where = f" at {r.host}:{r.port}" if r.host else ""
        console.print(f"  {r.name} {r.state}{' ready' if r.ready else ''}{where}")
    for at, kind, to, reason in events:
        console.print(f"  {at:%H:%M:%S} {kind} -> {to}: {escape(reason)}")


@endpoints_cli.command("scale")
def endpoints_scale(
    name: str = typer.Argument(..., help="The endpoint's name."),
    tenant: str = typer.Option(..., help="Tenant slug."),
    min_replicas: int = typer.Option(None, "--min", help="New floor."),
    max_replicas: int = typer.Option(None, "--max", help="New ceiling."),
) -> None:
    """Change an endpoint's bounds (its target is clipped to them at once)."""
    try:
        patch = EndpointPatch.model_validate(
            {"min_replicas": min_replicas, "max_replicas": max_replicas}
        )
    except ValidationError as e:
        fail(_errors(e), 2)
    with session_scope() as session:
        try:
            ep = service.update_endpoint(session, _acting(session, tenant), name, patch)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
        summary = f"endpoint {ep.name}: bounds {ep.min_replicas}..{ep.max_replicas}, target "
        summary += str(ep.target)
    console.print(summary)


@endpoints_cli.command("delete")
def endpoints_delete(
    name: str = typer.Argument(..., help="The endpoint's name."),
    tenant: str = typer.Option(..., help="Tenant slug."),
) -> None:
    """Delete an endpoint (its replicas are terminated)."""
    with session_scope() as session:
        try:
            service.delete_endpoint(session, _acting(session, tenant), name)
        except AppError as e:
            fail(escape(f"{e.detail} ({e.code})"), 2)
    console.print(f"endpoint {name} deleted")
