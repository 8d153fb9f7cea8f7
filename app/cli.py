"""`rackplane`: run the service, manage the fleet, tenants and keys from the server's shell."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

# Every model, so SQLAlchemy's metadata is whole whatever a command imports: a flush resolves
# every foreign key (`keys revoke` failed with "api_keys.tenant_id could not find table
# 'tenants'" when only app.models.keys was loaded). And the listeners that tell the API
# processes' key caches about a committed change to a key, tenant, quota or budget, so what
# the CLI changes there counts at once, as it does through the API.
import app.models  # noqa: F401
import app.tenancy.auth  # noqa: F401
from app.chaos import service as chaos_service
from app.chaos.schemas import ExperimentState, ExperimentSummaryOut
from app.core.config import get_settings
from app.core.db import session_scope
from app.core.schemas import PageParams

cli = typer.Typer(
    help="Rackplane: a multi-tenant GPU cloud control plane.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
fleet_cli = typer.Typer(help="Register and inspect the fleet.", no_args_is_help=True)
tenants_cli = typer.Typer(help="Onboard tenants.", no_args_is_help=True)
keys_cli = typer.Typer(help="Create and revoke API keys.", no_args_is_help=True)
cli.add_typer(fleet_cli, name="fleet")
cli.add_typer(tenants_cli, name="tenants")
billing_cli = typer.Typer(
    help="Exports, Stripe meter events, reconciliation.", no_args_is_help=True
)
cli.add_typer(keys_cli, name="keys")
chaos_cli = typer.Typer(
    help="Chaos experiments: faults through the telemetry path, within a blast radius.",
    no_args_is_help=True,
)
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


def _console(stderr: bool = False) -> Console:
    """On a terminal, its width. Piped or redirected, rich would cut tables and wrap lines at
    80 columns ("hgx-…", JSON split over lines): there every line is as long as what it holds,
    unless COLUMNS says otherwise."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, width=100_000 if piped else None)


console = _console()
err = _console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent
DEMO_FLEET = Path(__file__).resolve().parent / "fleet" / "demo_fleet.yaml"


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def migrate_db() -> None:
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


def seed_demo() -> dict | None:
    """On an empty database: the demo fleet, a demo tenant and its key, and an operator key."""
    from sqlalchemy import func, select

    from app.core.db import session_scope
    from app.fleet import document
    from app.fleet.service import apply_document
    from app.keys.service import create_key
    from app.models.tenants import Tenant
    from app.tenants.service import create_tenant

    with session_scope() as session:
        if session.scalar(select(func.count()).select_from(Tenant)):
            return None
        apply_document(session, document.load(DEMO_FLEET.read_text()))
        tenant = create_tenant(
            session, name="Demo Tenant", slug="demo", contact_email="demo@example.com"
        )
        tkey = create_key(
            session, tenant_id=tenant.id, name="demo", scopes=["read", "write", "admin"]
        )
        okey = create_key(session, tenant_id=None, name="operator", scopes=["platform"])
        # A price book from the start of the month, so the demo's usage is billed.
        from app.billing.demo_prices import seed_demo_prices
        from app.core.db import utcnow

        now = utcnow()
        seed_demo_prices(session, now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
        _seed_demo_work(session, tenant, tkey)
        return {"tenant_key": tkey.key, "operator_key": okey.key}


# The demo tenant's quotas, budget and work, so the portal has something to show from the first
# start: gangs on the NVL72 rack and the H200s, a MIG notebook, a fractional inference share, a
# VM, and a gang that waits. None of it touches the H100s (the README's walkthrough uses them).
DEMO_QUOTAS = [
    {"gpu_model": "GB200", "guaranteed_milli": 36_000, "limit_milli": 72_000},
    {"gpu_model": "H200-141GB", "guaranteed_milli": 8_000, "limit_milli": 32_000},
    {"gpu_model": "B200", "guaranteed_milli": 4_000, "limit_milli": 16_000},
    {"gpu_model": "A100-80GB", "guaranteed_milli": 2_000},
]
DEMO_WORK = [
    {
        "name": "llm-pretrain",
        "kind": "job",
        "replicas": 4,
        "gpus": 4,
        "gpu_models": ["GB200"],
        "topology": {"level": "nvlink_domain", "mode": "required"},
        "run_for_s": 8 * 3600,
        "checkpoint": {"interval_s": 900, "cost_s": 30},
    },
    {
        "name": "finetune-h200",
        "kind": "job",
        "replicas": 2,
        "gpus": 8,
        "gpu_models": ["H200-141GB"],
        "topology": {"level": "rack", "mode": "preferred"},
        "run_for_s": 4 * 3600,
    },
    {
        "name": "notebook",
        "kind": "instance",
        "mig_profile": "1g.10gb",
        "gpu_models": ["A100-80GB"],
        "run_for_s": 2 * 3600,
        "priority": "research",
    },
    {
        "name": "inference",
        "kind": "instance",
        "milli": 500,
        "gpu_memory_mib": 20_000,
        "gpu_models": ["B200"],
        "run_for_s": 6 * 3600,
        "priority": "production",
    },
    {
        "name": "batch-vm",
        "kind": "vm",
        "gpus": 2,
        "gpu_models": ["B200"],
        "run_for_s": 3 * 3600,
        "priority": "research",
    },
    {
        "name": "eval-h200",
        "kind": "job",
        "replicas": 2,
        "gpus": 8,
        "gpu_models": ["H200-141GB"],
        "run_for_s": 3600,
        "priority": "research",
    },
]


def _seed_demo_work(session, tenant, key) -> None:
    """Through the service, as the tenant's own requests would go (refusals are logged, not
    fatal: the demo starts whatever the catalogue says)."""
    from app.billing.budgets import set_budget
    from app.core.errors import AppError
    from app.tenancy.auth import key_context
    from app.workloads import service
    from app.workloads.schemas import QuotaIn, WorkloadCreate

    service.set_quotas(session, tenant.id, [QuotaIn(**q) for q in DEMO_QUOTAS])
    set_budget(session, tenant.id, currency="usd", spend_limit=2_000_000)  # $20,000 a month
    from app.core.db import utcnow
    from app.models.keys import ApiKey

    auth, _ = key_context(session, session.get(ApiKey, key.id), tenant, utcnow())
    for spec in DEMO_WORK:
        try:
            with session.begin_nested():
                service.submit(session, auth, WorkloadCreate(**spec))
        except (AppError, ValueError) as e:
            err.print(f"[yellow]demo workload {spec['name']} not submitted:[/yellow] {e}")


@cli.command()
def up(
    host: str = typer.Option(None, help="Bind address (default RACKPLANE_HOST or 127.0.0.1)."),
    port: int = typer.Option(None, help="Port (default RACKPLANE_PORT or 8000)."),
    worker: bool = typer.Option(True, help="Start a Celery worker (with beat) process."),
    concurrency: int = typer.Option(2, help="Worker processes."),
) -> None:
    """Migrate, seed a demo on first start, and run the API, a Celery worker and beat."""
    import uvicorn

    from app.core.secrets import check_server_secrets

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
    from app.portal.router import DIST

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
    from app.core.processes import stop_groups

    children: list[subprocess.Popen] = []
    if worker:
        from workers.settings import worker_command

        cmd = worker_command(
            f"rackplane-{os.getpid()}@%h",
            beat=True,
            concurrency=concurrency,
            loglevel=settings.log_level,
        )
        # Its own process group, so the worker's pool and beat children stop with it.
        children.append(subprocess.Popen(cmd, cwd=ROOT, start_new_session=True))
    sys.stdout.flush()

    def stop(*_a) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        uvicorn.run("app.main:app", host=host, port=port, log_config=None, access_log=False)
    except KeyboardInterrupt:
        pass
    finally:
        stop_groups(children)


@cli.command("worker")
def run_worker(concurrency: int = 2, beat: bool = True) -> None:
    """Run a Celery worker (and beat) for every queue."""
    from workers.settings import worker_command

    args = worker_command(beat=beat, concurrency=concurrency)
    raise typer.Exit(subprocess.call(args, cwd=ROOT))


@fleet_cli.command("import")
def fleet_import(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True),
    dry_run: bool = typer.Option(False, help="Validate only."),
) -> None:
    """Validate a fleet file whole and apply it (nothing is written unless all of it is valid)."""
    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.fleet import document
    from app.fleet.service import apply_document, refuse_conflicts

    fmt = "json" if file.suffix.lower() == ".json" else "yaml"
    try:
        doc = document.load(file.read_text(encoding="utf-8"), fmt=fmt)
    except document.FleetDocumentError as exc:
        for e in exc.errors:
            where = f"{file}:{e['line']}" if e.get("line") else str(file)
            err.print(f"{where}: [bold]{e['field'] or '(document)'}[/bold]: {e['message']}")
        _fail(f"{len(exc.errors)} error(s); nothing was imported", 2)
    try:
        with session_scope() as session:
            if dry_run:  # against the fleet as it is, as the import itself checks
                refuse_conflicts(session, doc)
                console.print(f"valid: {document.summarize(doc)}")
                return
            summary = apply_document(session, doc)
    except AppError as exc:
        for e in exc.extra.get("errors", []):
            err.print(f"{file}: [bold]{e['field']}[/bold]: {e['message']}")
        _fail(exc.detail, 2)
    console.print(json.dumps(summary))


@fleet_cli.command("show")
def fleet_show() -> None:
    """Capacity by region and GPU model."""
    from app.core.db import session_scope
    from app.fleet.service import capacity

    with session_scope() as session:
        rows = capacity(session)
    table = Table("region", "gpu model", "total", "free whole", "free milli", "free MIG")
    for r in rows:
        mig = ", ".join(f"{k}: {v}" for k, v in sorted(r["free_mig"].items()))
        table.add_row(
            r["region"],
            r["gpu_model"],
            str(r["total_gpus"]),
            str(r["free_gpus"]),
            str(r["free_milli"]),
            mig or "-",
        )
    console.print(table)


@fleet_cli.command("health")
def fleet_health(
    as_json: bool = typer.Option(False, "--json", help="The same as GET /v1/admin/health."),
) -> None:
    """What is out of the pool and why, per region and rack; open incidents."""
    from app.core.db import session_scope
    from app.health.schemas import FleetHealth
    from app.health.service import summary

    with session_scope() as session:
        report = FleetHealth.model_validate(summary(session))
    if as_json:
        console.print_json(report.model_dump_json())
        return
    table = Table(
        "region",
        "rack",
        "GPUs",
        "healthy",
        "suspect",
        "out",
        "out of service",
        "allocated",
        "idle",
        "unavailable",
    )
    for reg in report.regions:
        for rk in reg.racks:
            h = rk.by_health
            out = sum(v for k, v in h.items() if k not in ("healthy", "suspect", "out_of_service"))
            table.add_row(
                reg.region,
                rk.rack,
                str(rk.gpus),
                str(h.get("healthy", 0)),
                str(h.get("suspect", 0)),
                str(out),
                str(h.get("out_of_service", 0)),
                str(rk.by_allocation.allocated),
                str(rk.by_allocation.idle),
                str(rk.by_allocation.unavailable),
            )
    console.print(table)
    out_table = Table("region", "rack", "node", "GPU", "state", "since", "why")
    for reg in report.regions:
        for rk in reg.racks:
            for o in rk.out:
                out_table.add_row(
                    reg.region,
                    rk.rack,
                    o.node,
                    "node" if o.gpu_index is None else str(o.gpu_index),
                    o.health,
                    f"{o.since:%Y-%m-%d %H:%M:%S}" if o.since else "-",
                    o.reason or "-",
                )
    if out_table.row_count:
        console.print(out_table)
    else:
        console.print("Every GPU is healthy.")
    if report.incidents:
        inc = Table("opened", "node", "class", "what", "GPUs", "signals", "state", "held back")
        for i in report.incidents:
            inc.add_row(
                f"{i.opened_at:%H:%M:%S}",
                i.node or "-",
                i.action,
                i.what,
                ",".join(map(str, i.gpu_indices)) or "-",
                str(i.signals),
                i.state,
                i.held_back or "-",
            )
        console.print(inc)


def _health_action(action: str, node_name: str, gpu: int | None, reason: str | None) -> None:
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.health.service import operator_action
    from app.models.fleet import Gpu, Node

    try:
        with session_scope() as session:
            node = session.scalar(select(Node).where(Node.name == node_name).with_for_update())
            if node is None:
                _fail(f"no node named {node_name}", 2)
            target = None
            if gpu is not None:
                target = session.scalar(
                    select(Gpu).where(Gpu.node_id == node.id, Gpu.index == gpu).with_for_update()
                )
                if target is None:
                    _fail(f"node {node_name} has no GPU {gpu}", 2)
            health = operator_action(session, node, target, action, reason)
    except AppError as exc:
        _fail(exc.detail, 2)
    what = f"GPU {gpu} of {node_name}" if gpu is not None else node_name
    console.print(f"{what}: {health}")


@fleet_cli.command("quarantine")
def fleet_quarantine(
    node: str,
    gpu: int | None = typer.Option(None, help="One GPU (its index); default: the whole node."),
    reason: str | None = typer.Option(None),
) -> None:
    """Take a GPU (or node) out of the pool now; its work is requeued ahead of its peers."""
    _health_action("quarantine", node, gpu, reason)


@fleet_cli.command("release")
def fleet_release(
    node: str,
    gpu: int | None = typer.Option(None, help="One GPU (its index); default: the whole node."),
    reason: str | None = typer.Option(None),
) -> None:
    """Return a GPU (or node) to service (through validation if it was out of service)."""
    _health_action("release", node, gpu, reason)


@fleet_cli.command("retire")
def fleet_retire(
    node: str,
    gpu: int | None = typer.Option(None, help="One GPU (its index); default: the whole node."),
    reason: str | None = typer.Option(None),
) -> None:
    """Take a GPU (or node) out of service (RMA); its work is requeued."""
    _health_action("retire", node, gpu, reason)


@fleet_cli.command("history")
def fleet_history(
    node: str,
    gpu: int | None = typer.Option(None, help="Only this GPU's transitions."),
    limit: int = typer.Option(50, min=1, max=1000),
) -> None:
    """A node's (and its GPUs') health transitions, newest first."""
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.health.service import history
    from app.models.fleet import Node

    with session_scope() as session:
        row = session.scalar(select(Node).where(Node.name == node))
        if row is None:
            _fail(f"no node named {node}", 2)
        events = history(session, row, gpu, limit)
        table = Table("at", "GPU", "from", "to", "by", "cause")
        for e in events:
            table.add_row(
                f"{e.at:%Y-%m-%d %H:%M:%S}",
                "node" if e.gpu_index is None else str(e.gpu_index),
                e.from_state,
                e.to_state,
                e.actor,
                e.cause,
            )
    console.print(table)


def _chaos_print(exp_out: dict, as_json: bool) -> None:
    from app.chaos.schemas import ExperimentOut

    out = ExperimentOut.model_validate(exp_out)
    if as_json:
        console.print_json(out.model_dump_json())
        return
    console.print(
        f"experiment {out.id} ({out.name}): {out.state}, round {out.rounds}"
        + (f" (next at {out.next_at:%Y-%m-%d %H:%M:%S})" if out.next_at else "")
        + f", {out.gpus_touched} GPU(s) in its "
        f"blast radius; invariants {'held' if out.held else 'BROKEN'}: "
        + ", ".join(f"{k} {v}" for k, v in out.invariants.model_dump().items())
    )
    table = Table(
        "node",
        "GPU",
        "incident class",
        "detect s",
        "quarantine s",
        "requeue s",
        "running s",
        "workloads",
        "lost GPU-s",
    )

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for f in out.report:
        table.add_row(
            f.node,
            str(f.gpu_index),
            f.action or "-",
            s(f.detect_s),
            s(f.quarantine_s),
            s(f.requeue_s),
            s(f.running_s),
            str(len(f.workloads)),
            f"{f.lost_work_gpu_s:.1f}",
        )
    console.print(table)


@chaos_cli.command("inject")
def chaos_inject(
    max_gpus: int = typer.Option(..., min=1, help="Blast radius: the most GPUs taken out."),
    max_share: float = typer.Option(..., min=0.0001, max=1.0, help="Blast radius: region share."),
    xid: int | None = typer.Option(None, help="Inject this Xid."),
    ecc: bool = typer.Option(False, help="Inject uncorrectable ECC errors instead."),
    throttle: float | None = typer.Option(
        None, min=0.1, max=0.99, help="Thermal throttling instead: the clock share left."
    ),
    node_loss: bool = typer.Option(False, help="Lose the node instead: its heartbeat stops."),
    nvlink: bool = typer.Option(False, help="NVLink errors on the target's NVLink domain."),
    provider_fails: str | None = typer.Option(
        None, help="The provider fails to 'boot' or to 'repair' on the target's nodes instead."
    ),
    rack: str | None = typer.Option(None, help="Target: every node (GPU) of this rack."),
    noisy_neighbour: float | None = typer.Option(
        None,
        help="A noisy neighbour on the shared --node --gpu instead: its other workloads' step "
        "time over their best (e.g. 2).",
    ),
    node: str | None = typer.Option(
        None, help="Target: this node's --gpu (the node itself for --node-loss, --nvlink)."
    ),
    gpu: int | None = typer.Option(None),
    random_gpus: int | None = typer.Option(None, help="Target: N random GPUs holding work."),
    tier: str | None = typer.Option(None, help="With --random-gpus: only work of this tier."),
    name: str = typer.Option("chaos from the CLI"),
    at: str | None = typer.Option(None, help="First round at this time (ISO 8601, with offset)."),
    every: int | None = typer.Option(None, help="Seconds between rounds (with --times)."),
    times: int = typer.Option(1, help="Rounds in all."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Start an experiment now or on a schedule (needs RACKPLANE_CHAOS_ENABLED=true in this
    process's environment or ./.env, as the server does)."""
    from pydantic import ValidationError

    from app.chaos import service
    from app.chaos.schemas import ExperimentIn
    from app.core.db import session_scope
    from app.core.errors import AppError

    target: dict = (
        {"node": node, "gpu": gpu} if node else {"random_gpus": random_gpus, "holding_tier": tier}
    )
    if node and gpu is None:
        target = {"node": node}
    if rack:
        target = {"rack": rack}
    fault: dict = {"kind": "xid", "code": xid, "target": target}
    if noisy_neighbour is not None:
        fault = {"kind": "noisy_neighbour", "slowdown": noisy_neighbour, "target": target}
    elif provider_fails:
        fault = {"kind": "provider", "fails": provider_fails, "target": target}
    elif node_loss:
        fault = {"kind": "node_loss", "target": target}
    elif nvlink:
        fault = {"kind": "nvlink", "target": target}
    elif ecc:
        fault = {"kind": "ecc_dbe", "target": target}
    elif throttle is not None:
        fault = {"kind": "throttle", "speed": throttle, "target": target}
    try:
        body = ExperimentIn.model_validate(
            {
                "name": name,
                "faults": [fault],
                "blast_radius": {"max_gpus": max_gpus, "max_region_share": max_share},
                "schedule": None
                if at is None and times == 1
                else {
                    "at": at,
                    "times": times,
                    **({"every_s": every} if every is not None else {}),
                },
            }
        )
        with session_scope() as session:
            out = chaos_service.experiment_view(session, service.start(session, body))
    except ValidationError as exc:
        _fail("; ".join(e["msg"] for e in exc.errors()), 2)
    except service.ChaosDisabled:
        # The CLI is a process of its own that writes to the database itself: it reads the
        # switch as the server does (its environment, then ./.env), not from the server. Set
        # where both read it, they agree.
        _fail(
            "chaos experiments are off for this command: the CLI reads RACKPLANE_CHAOS_ENABLED "
            "from its own environment or ./.env, as the server does; set "
            "RACKPLANE_CHAOS_ENABLED=true in .env (read by both) or export it in this shell too",
            2,
        )
    except AppError as exc:
        _fail(exc.detail, 2)
    _chaos_print(out, as_json)


@chaos_cli.command("list")
def chaos_list(
    state: ExperimentState | None = typer.Option(None, help="Only experiments in this state."),
    as_json: bool = typer.Option(
        False, "--json", help="The items of GET /v1/admin/chaos/experiments, every page."
    ),
) -> None:
    """Every experiment, oldest first: its id (for `chaos report` and `chaos stop`), state,
    rounds and the GPUs in its blast radius."""
    rows: list[ExperimentSummaryOut] = []
    cursor = None
    with session_scope() as session:
        while True:
            items, cursor = chaos_service.list_experiments(
                session, PageParams(limit=500, cursor=cursor), state=state and state.value
            )
            rows += [ExperimentSummaryOut.model_validate(x) for x in items]
            if cursor is None:
                break
    if as_json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table("id", "name", "state", "rounds", "GPUs", "started", "stopped / next round")
    for r in rows:
        last = r.stopped_at or r.next_at
        table.add_row(
            str(r.id),
            r.name,
            r.state + (f" ({r.abort_reason})" if r.abort_reason else ""),
            str(r.rounds),
            str(r.gpus_touched),
            f"{r.started_at:%Y-%m-%d %H:%M:%S}",
            f"{last:%Y-%m-%d %H:%M:%S}" if last else "-",
        )
    console.print(table if rows else "No experiments.")


@chaos_cli.command("report")
def chaos_report(experiment: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """An experiment's report: per fault, the health loop's times; the invariants."""
    from app.core.db import get_or_404, session_scope
    from app.core.errors import AppError
    from app.models.chaos import ChaosExperiment

    try:
        with session_scope() as session:
            out = chaos_service.experiment_view(
                session, get_or_404(session, ChaosExperiment, experiment, what="experiment")
            )
    except AppError as exc:
        _fail(exc.detail, 2)
    _chaos_print(out, as_json)


@chaos_cli.command("stop")
def chaos_stop(experiment: str) -> None:
    """Stop an experiment and undo what it injected."""
    from app.chaos import service
    from app.core.db import get_or_404, session_scope
    from app.core.errors import AppError
    from app.models.chaos import ChaosExperiment

    try:
        with session_scope() as session:
            exp = get_or_404(
                session, ChaosExperiment, experiment, what="experiment", for_update=True
            )
            service.stop(session, exp)
            out = chaos_service.experiment_view(session, exp)
    except AppError as exc:
        _fail(exc.detail, 2)
    _chaos_print(out, False)


@tenants_cli.command("create")
def tenants_create(
    name: str = typer.Option(...),
    slug: str = typer.Option(...),
    email: str = typer.Option(...),
    policy: list[str] | None = typer.Option(None, help="Allowed isolation tier (repeat)."),
    with_key: bool = typer.Option(True, help="Also create an admin key and print it."),
) -> None:
    """Create an active tenant (and its first admin key)."""
    from pydantic import ValidationError

    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.keys.service import create_key
    from app.tenants.schemas import TenantCreate
    from app.tenants.service import create_tenant

    try:
        body = TenantCreate(name=name, slug=slug, contact_email=email, isolation_policy=policy)
    except ValidationError as exc:
        _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()), 2)
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
        _fail(exc.detail, 2)
    console.print(f"tenant {slug} created: {tid}")
    if key:
        console.print(f"admin key (shown once): {key.key}")


@tenants_cli.command("list")
def tenants_list() -> None:
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.models.tenants import Tenant

    table = Table("slug", "name", "status", "id")
    with session_scope() as session:
        for t in session.scalars(select(Tenant).order_by(Tenant.slug)):
            table.add_row(t.slug, t.name, t.status, str(t.id))
    console.print(table)


@tenants_cli.command("approve")
def tenants_approve(slug: str) -> None:
    """Approve a tenant that signed up itself."""
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.models.tenants import Tenant
    from app.tenants.service import approve

    try:
        with session_scope() as session:
            tenant = session.scalar(select(Tenant).where(Tenant.slug == slug))
            if tenant is None:
                _fail(f"no tenant {slug}", 2)
            approve(tenant)
    except AppError as exc:
        _fail(exc.detail, 2)
    console.print(f"tenant {slug} is active")


@keys_cli.command("create")
def keys_create(
    tenant: str | None = typer.Option(None, help="Tenant slug."),
    platform: bool = typer.Option(False, "--platform", help="An operator key."),
    name: str = typer.Option("cli"),
    scope: list[str] | None = typer.Option(None, help="read, write or admin (repeat)."),
) -> None:
    """Create an API key and print it (once)."""
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.keys.service import create_key
    from app.models.tenants import Tenant

    if platform == bool(tenant):
        _fail("give either --tenant SLUG or --platform", 2)
    scopes = ["platform"] if platform else list(dict.fromkeys(scope or ["read", "write"]))
    if not platform and not set(scopes) <= {"read", "write", "admin"}:
        _fail("tenant key scopes are read, write and admin", 2)
    with session_scope() as session:
        tenant_id = None
        if tenant:
            tenant_id = session.scalar(select(Tenant.id).where(Tenant.slug == tenant))
            if tenant_id is None:
                _fail(f"no tenant {tenant}", 2)
        key = create_key(session, tenant_id=tenant_id, name=name, scopes=scopes)
    console.print(f"key {key.prefix} ({', '.join(scopes)}), shown once:\n{key.key}")


@keys_cli.command("revoke")
def keys_revoke(prefix: str) -> None:
    """Revoke a key by its public prefix (the 8 characters after `rp_`)."""
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.keys.service import revoke
    from app.models.keys import ApiKey

    with session_scope() as session:
        key = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
        if key is None:
            _fail(f"no key with prefix {prefix}", 2)
        revoke(key)
    console.print(f"key {prefix} revoked")


@billing_cli.command("export")
def billing_export(
    period: str = typer.Option(..., help="The month, e.g. 2026-11."),
    format: str = typer.Option("csv", help="csv or jsonl."),
    output: Path | None = typer.Option(None, "--output", "-o", help="File (default: stdout)."),
) -> None:
    """Every tenant's month for finance: one row per day, tenant, SKU, tier, region, plan and
    price version (the same rows as GET /v1/admin/billing/exports)."""
    from app.billing import exports
    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.tenancy.auth import SYSTEM

    if format not in exports.FORMATS:
        _fail(f"format must be one of {', '.join(exports.FORMATS)}", 2)
    try:
        with session_scope() as session:
            rows = exports.export_rows(session, SYSTEM, period)
    except AppError as exc:
        _fail(exc.detail or exc.title, 2)
    out = open(output, "w", newline="") if output else sys.stdout
    try:
        for chunk in exports.stream(rows, format):
            out.write(chunk)
    finally:
        if output:
            out.close()
    if output:
        err.print(f"wrote {len(rows)} rows to {output}")


@billing_cli.command("push")
def billing_push() -> None:
    """Plan the meter events the ledger owes Stripe and send them now (what the beat task
    `billing.meter_export` does every RACKPLANE_METER_EXPORT_EVERY seconds)."""
    from dataclasses import asdict

    from app.billing import stripe_export
    from app.billing.stripe_gateway import gateway
    from app.core.db import session_scope

    if gateway() is None:
        _fail("Stripe is not configured (set RACKPLANE_STRIPE_API_KEY)", 2)
    with session_scope() as session:
        planned = stripe_export.plan(session)
    sent = stripe_export.send()
    console.print_json(json.dumps({"planned": asdict(planned), "sent": asdict(sent)}, default=str))


@billing_cli.command("reconcile")
def billing_reconcile(
    period: str = typer.Option(..., help="The month, e.g. 2026-11."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Ledger totals against what Stripe was sent, per tenant and meter; exits 1 on any
    difference."""
    from app.billing import stripe_export
    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.tenancy.auth import SYSTEM

    try:
        with session_scope() as session:
            report = stripe_export.reconcile(session, SYSTEM, period)
    except AppError as exc:
        _fail(exc.detail or exc.title, 2)
    if as_json:
        console.print_json(json.dumps(report, default=str))
    else:
        table = Table("tenant", "meter", "ledger", "exported", "adjusted", "difference", "pending")
        for r in report["rows"]:
            table.add_row(
                str(r["tenant_id"]),
                r["meter"],
                str(r["ledger_milli_gpu_ms"]),
                str(r["exported_milli_gpu_ms"]),
                str(r["adjusted_milli_gpu_ms"]),
                str(r["difference_milli_gpu_ms"]),
                str(r["pending_events"]),
            )
        console.print(table)
        console.print(f"through {report['through']}: {report['differences']} difference(s)")
    if report["differences"]:
        raise typer.Exit(1)


@cli.command()
def openapi(
    check: bool = typer.Option(False, help="Fail if openapi/openapi.json is out of date."),
    out: Path = typer.Option(ROOT / "openapi" / "openapi.json"),
) -> None:
    """Write the OpenAPI document generated from the app."""
    from app.main import create_app

    text = json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"
    if check:
        if not out.exists() or out.read_text() != text:
            _fail(f"{out} is out of date; run `make openapi`")
        console.print(f"{out} is up to date")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"wrote {out}")
    # The GraphQL schema beside it (`make openapi` keeps both current).
    from app.graphql.schema import schema

    sdl = ROOT / "sdl" / "schema.graphql"
    sdl.parent.mkdir(parents=True, exist_ok=True)
    sdl.write_text(schema.as_str() + "\n")
    console.print(f"wrote {sdl}")


def main() -> None:
    from app.core.secrets import MissingSecret

    try:
        cli()
    except MissingSecret as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
