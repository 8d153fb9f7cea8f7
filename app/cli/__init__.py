"""`rackplane`: run the service, manage the fleet, tenants and keys from the server's shell.

The commands that run the service (`migrate`, `up`, `worker`, `openapi`) are here; each domain's
are a typer sub-application of their own module (`rackplane fleet ...` in app/cli/fleet.py, and
so on). The tools installed beside the product (`rackplane bench`, `rackplane sim`) join through
the `rackplane.cli` entry point group.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import typer

# Every model, so SQLAlchemy's metadata is whole whatever a command imports: a flush resolves
# every foreign key (`keys revoke` failed with "api_keys.tenant_id could not find table
# 'tenants'" when only app.models.keys was loaded). And the listeners that tell the API
# processes' key caches about a committed change to a key, tenant, quota or budget, so what
# the CLI changes there counts at once, as it does through the API.
import app.models  # noqa: F401
import app.tenancy.auth  # noqa: F401
from app.cli.billing import billing_cli
from app.cli.chaos import chaos_cli
from app.cli.common import DEMO_FLEET, ROOT, console, err, fail
from app.cli.demo import seed_demo
from app.cli.endpoints import endpoints_cli
from app.cli.fleet import fleet_cli
from app.cli.keys import keys_cli
from app.cli.secrets import secrets_cli
from app.cli.ssh_keys import ssh_keys_cli
from app.cli.tenants import tenants_cli
from app.cli.volumes import volumes_cli
from app.cli.workloads import workloads_cli
from app.core.config import get_settings
from app.core.processes import stop_groups
from app.core.secrets import MissingSecret, check_server_secrets
from app.portal import DIST
from workers.settings import worker_command

__all__ = ["DEMO_FLEET", "ROOT", "cli", "main", "migrate_db"]

cli = typer.Typer(
    help="Rackplane: a multi-tenant GPU cloud control plane.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
cli.add_typer(fleet_cli, name="fleet")
cli.add_typer(tenants_cli, name="tenants")
cli.add_typer(keys_cli, name="keys")
cli.add_typer(ssh_keys_cli, name="ssh-keys")
cli.add_typer(secrets_cli, name="secrets")
cli.add_typer(volumes_cli, name="volumes")
cli.add_typer(endpoints_cli, name="endpoints")
cli.add_typer(workloads_cli, name="workloads")
cli.add_typer(chaos_cli, name="chaos")
cli.add_typer(billing_cli, name="billing")


def _add_tools() -> None:
    """The tools installed beside the product (`rackplane bench`, `rackplane sim`), found by the
    `rackplane.cli` entry point group: they import the product, which never imports them."""
    for tool in entry_points(group="rackplane.cli"):
        try:
            commands = tool.load()
        except ModuleNotFoundError as e:
            if e.name != tool.module.split(".")[0]:
                raise
            continue  # an install of the product alone (the container image) has no tools
        cli.add_typer(commands, name=tool.name)


_add_tools()


def _add_programs() -> None:
    """Programs installed beside the CLI that parse their own arguments (`rackplane agent`, the
    node agent): loaded only when named, and never imported by the product."""

    def runner(program):
        def run(ctx: typer.Context) -> None:
            sys.exit(program.load()(list(ctx.args)))

        return run

    for program in entry_points(group="rackplane.programs"):
        run = runner(program)
        cli.command(
            name=program.name,
            help=f"Run `{program.value.split(':')[0]}` (its own options: `rackplane "
            f"{program.name} --help`).",
            context_settings={
                "allow_extra_args": True,
                "ignore_unknown_options": True,
                "help_option_names": [],
            },
            add_help_option=False,
        )(run)


_add_programs()


def migrate_db() -> None:
    # Deferred: alembic (~120 ms) is for migrate and up alone, not every command.
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    command.upgrade(cfg, "head")


@cli.command()
def migrate() -> None:
    """Apply database migrations (alembic upgrade head)."""
    migrate_db()
    console.print("database is at the latest migration")


@cli.command()
def up(
    host: str = typer.Option(None, help="Bind address (default RACKPLANE_HOST or 127.0.0.1)."),
    port: int = typer.Option(None, help="Port (default RACKPLANE_PORT or 8000)."),
    worker: bool = typer.Option(True, help="Start a Celery worker (with beat) process."),
    concurrency: int = typer.Option(2, help="Worker processes."),
    agent: bool = typer.Option(
        None,
        help="Add the local node local-0 (4 made-up GPUs) and run its node agent "
        "(default RACKPLANE_LOCAL_AGENT: on).",
    ),
) -> None:
    """Migrate, seed a demo on first start, and run the API, a Celery worker and beat."""
    from app.cli.serve import serve  # deferred: `up` alone runs a server (uvicorn, ~11 ms)

    settings = get_settings()
    host = host or settings.api_host
    port = port or settings.api_port
    check_server_secrets()  # before anything is written: no key may be hashed without a pepper
    migrate_db()
    seeded = seed_demo() if settings.seed_demo else None
    base = f"http://{host}:{port}"
    console.print(
        f"[bold]Rackplane[/bold] on {'SQLite (embedded)' if settings.is_sqlite else 'PostgreSQL'}"
        f", broker {'SQLite (embedded)' if not settings.redis_url else 'Redis'}"
    )
    sign_in = "sign in with a key below" if seeded else "sign in with an API key"
    portal = (
        f"{base}/portal/  ({sign_in})"
        if (DIST / "index.html").is_file()
        else "not built (needs Node.js and npm: `make portal`)"
    )
    console.print(
        f"  portal     {portal}\n"
        f"  API        {base}/v1\n  API docs   {base}/docs\n  OpenAPI    {base}/openapi.json\n"
        f"  health     {base}/healthz  {base}/readyz\n  metrics    {base}/metrics"
    )
    if seeded:
        console.print(
            "[bold green]Demo seeded[/bold green] (keys are shown once; only hashes are stored):"
        )
        console.print(f"  demo tenant key  {seeded['tenant_key']}")
        console.print(f"  operator key     {seeded['operator_key']}")
        # Printed whole (no wrapping), so it can be pasted.
        console.print(
            f"  try: curl -H 'Authorization: Bearer {seeded['tenant_key']}' {base}/v1/capacity",
            soft_wrap=True,
        )
    else:
        # Keys are shown once, when made: after a restart, say how to make one.
        slug = "demo" if settings.seed_demo else "SLUG"
        console.print(
            "  keys       shown once when made; make one with\n"
            f"             .venv/bin/rackplane keys create --tenant {slug} --scope read "
            "--scope write --scope admin\n"
            "             .venv/bin/rackplane keys create --platform   (an operator's)",
            soft_wrap=True,
        )
    children: list[subprocess.Popen] = []

    def stop(*_a) -> None:
        raise KeyboardInterrupt

    # SIGTERM (systemd, `docker stop`, kill) stops it as SIGINT does, from here on: a signal
    # while the children start stops those already started too.
    signal.signal(signal.SIGTERM, stop)
    try:
        serve(host, port, base, children, agent, worker, concurrency)
    except KeyboardInterrupt:
        pass
    finally:
        stop_groups(children)


@cli.command("gateway")
def run_gateway(
    host: str = typer.Option(None, help="Bind address (default RACKPLANE_HOST or 127.0.0.1)."),
    port: int = typer.Option(None, help="Port (default RACKPLANE_GATEWAY_PORT or 8001)."),
) -> None:
    """Run an inference gateway: /e/{endpoint}/... to the endpoints' ready replicas (stateless:
    run as many as you like, behind one address)."""
    from app.cli.serve import gateway  # deferred: uvicorn, for the commands that serve

    settings = get_settings()
    gateway(host or settings.api_host, port or settings.gateway_port or 8001)


@cli.command("worker")
def run_worker(concurrency: int = 2, beat: bool = True) -> None:
    """Run a Celery worker (and beat) for every queue."""
    args = worker_command(beat=beat, concurrency=concurrency)
    raise typer.Exit(subprocess.call(args, cwd=ROOT))


@cli.command()
def openapi(
    check: bool = typer.Option(False, help="Fail if openapi/openapi.json is out of date."),
    out: Path = typer.Option(ROOT / "openapi" / "openapi.json"),
) -> None:
    """Write the OpenAPI document generated from the app."""
    # Deferred: the whole app, REST and GraphQL (~600 ms), for this command alone.
    from app.graphql.schema import schema
    from app.main import create_app

    text = json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"
    if check:
        if not out.exists() or out.read_text() != text:
            fail(f"{out} is out of date; run `make openapi`")
        console.print(f"{out} is up to date")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"wrote {out}")
    # The GraphQL schema beside it (`make openapi` keeps both current).
    sdl = ROOT / "sdl" / "schema.graphql"
    sdl.parent.mkdir(parents=True, exist_ok=True)
    sdl.write_text(schema.as_str() + "\n")
    console.print(f"wrote {sdl}")


def main() -> None:
    try:
        cli()
    except MissingSecret as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(2)
