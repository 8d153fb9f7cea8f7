"""`rackplane fleet ...`: register and inspect the fleet, and take GPUs out of the pool and back."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.table import Table
from sqlalchemy import select

from app.agents import mig
from app.agents.schemas import MigLayoutIn
from app.agents.service import create_join_token, node_named
from app.cli.common import console, err, fail
from app.core.db import session_scope
from app.core.errors import AppError
from app.fleet import document, upgrades
from app.fleet.schemas import UpgradeCreate
from app.fleet.service import apply_document, capacity, refuse_conflicts
from app.health.operators import operator_action
from app.health.schemas import FleetHealth
from app.health.views import history, summary
from app.models.fleet import Gpu, Node
from app.stacks import service as stacks
from app.stacks.schemas import StackAssign, StackCreate

fleet_cli = typer.Typer(help="Register and inspect the fleet.", no_args_is_help=True)


@fleet_cli.command("import")
def fleet_import(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True),
    dry_run: bool = typer.Option(False, help="Validate only."),
) -> None:
    """Validate a fleet file whole and apply it (nothing is written unless all of it is valid)."""
    fmt = "json" if file.suffix.lower() == ".json" else "yaml"
    try:
        doc = document.load(file.read_text(encoding="utf-8"), fmt=fmt)
    except document.FleetDocumentError as exc:
        for e in exc.errors:
            where = f"{file}:{e['line']}" if e.get("line") else str(file)
            err.print(f"{where}: [bold]{e['field'] or '(document)'}[/bold]: {e['message']}")
        fail(f"{len(exc.errors)} error(s); nothing was imported", 2)
    try:
        with session_scope() as session:
            if dry_run:  # against the fleet as it is, as the import itself checks
                refuse_conflicts(session, doc)
                # JSON, as the import itself prints (it printed a Python dict).
                print(json.dumps({"valid": True, "totals": document.summarize(doc)}))
                return
            applied = apply_document(session, doc)
    except AppError as exc:
        for e in exc.extra.get("errors", []):
            err.print(f"{file}: [bold]{e['field']}[/bold]: {e['message']}")
        fail(exc.detail, 2)
    print(json.dumps(applied))  # JSON unwrapped, for tools


@fleet_cli.command("show")
def fleet_show() -> None:
    """Capacity by region and GPU model."""
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
    try:
        with session_scope() as session:
            node = session.scalar(select(Node).where(Node.name == node_name).with_for_update())
            if node is None:
                fail(f"no node named {node_name}", 2)
            target = None
            if gpu is not None:
                target = session.scalar(
                    select(Gpu).where(Gpu.node_id == node.id, Gpu.index == gpu).with_for_update()
                )
                if target is None:
                    fail(f"node {node_name} has no GPU {gpu}", 2)
            health = operator_action(session, node, target, action, reason)
    except AppError as exc:
        fail(exc.detail, 2)
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
    with session_scope() as session:
        row = session.scalar(select(Node).where(Node.name == node))
        if row is None:
            fail(f"no node named {node}", 2)
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


@fleet_cli.command("join-token")
def fleet_join_token(
    node: str,
    ttl: int = typer.Option(900, min=60, max=86400, help="Seconds it may be used in (once)."),
    adopt: bool = typer.Option(
        False,
        "--adopt",
        help="The agent's first inventory becomes NODE's GPUs' record (no typing them twice).",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A single-use join token for NODE's agent (`rackplane agent --token`), shown once.

    With --adopt, what the agent reads through NVML (the GPUs' model, count, MIG mode and
    UUIDs) becomes the node's record when it joins, where the node's rack kind sells that
    model and count (a `pcie` rack: 1 to 10 GPUs of any PCIe model) and nothing runs on it;
    otherwise a difference keeps the node validating, as without --adopt."""
    with session_scope() as session:
        row = node_named(session, node)
        if row is None:
            fail(f"no node named {node}", 2)
        made = create_join_token(session, row, ttl, adopt)
    if as_json:
        print(made.model_dump_json())
        return
    console.print(made.token)
    err.print(
        f"for {made.node_name}, single use, until {made.expires_at:%Y-%m-%d %H:%M:%S}Z"
        + (": its agent's inventory becomes the node's record" if adopt else "")
    )


stack_cli = typer.Typer(
    help="Software stacks: pinned driver, CUDA, NCCL, firmware... and which nodes run each.",
    no_args_is_help=True,
)
fleet_cli.add_typer(stack_cli, name="stack")


def _stack_call(fn):
    """Run a stack service call in one transaction; its refusal is the CLI's exit 2."""
    try:
        with session_scope() as session:
            return fn(session)
    except AppError as exc:
        fail(exc.detail, 2)
    except ValidationError as exc:
        fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()), 2)


@stack_cli.command("create")
def stack_create(
    name: str,
    driver: str = typer.Option(..., help="NVIDIA driver, e.g. 560.35.03"),
    cuda: str = typer.Option(..., help="CUDA, MAJOR.MINOR, e.g. 12.6"),
    nccl: str | None = typer.Option(None),
    firmware: str | None = typer.Option(None, help="GPU firmware / VBIOS"),
    fabric_manager: str | None = typer.Option(None),
    os_image: str | None = typer.Option(None),
    description: str | None = typer.Option(None),
) -> None:
    """Declare a stack (stacks never change: a new version is a new name)."""
    components = {
        "driver": driver,
        "cuda": cuda,
        "nccl": nccl,
        "firmware": firmware,
        "fabric_manager": fabric_manager,
        "os_image": os_image,
    }
    out = _stack_call(
        lambda s: stacks.create(
            s,
            StackCreate.model_validate(
                {
                    "name": name,
                    "description": description,
                    "components": {k: v for k, v in components.items() if v is not None},
                }
            ),
        )
    )
    console.print(f"stack {out.name}: " + ", ".join(f"{k} {v}" for k, v in out.components.items()))


@stack_cli.command("list")
def stack_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """The stacks, with how many nodes should run each and how many of those drifted."""
    rows = _stack_call(stacks.list_all)
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table("stack", "components", "nodes", "drifted")
    for r in rows:
        parts = ", ".join(f"{k} {v}" for k, v in r.components.items())
        table.add_row(r.name, parts, str(r.nodes), str(r.drifted))
    console.print(table)


@stack_cli.command("assign")
def stack_assign(
    name: str,
    pool: str | None = typer.Option(None, help="Every node of this pool"),
    region: str | None = typer.Option(None, help="Every node of this region"),
    node: list[str] | None = typer.Option(None, help="This node (repeat for more)"),
) -> None:
    """Declare that a pool's, a region's or the named nodes should run stack NAME, at once
    (busy nodes move a batch at a time with an upgrade)."""
    out = _stack_call(
        lambda s: stacks.assign(
            s,
            stacks.get(s, name),
            StackAssign.model_validate({"pool": pool, "region": region, "nodes": node or None}),
        )
    )
    console.print(f"{out.nodes} node(s) should run {out.stack}; {out.drifted} drifted")


def _pct(text: str) -> float:
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        fail(f"--max-unavailable takes a percentage, e.g. 10%; not {text!r}", 2)
    return value


@fleet_cli.command("upgrade")
def fleet_upgrade(
    stack: str = typer.Option(..., help="The stack to move the nodes to"),
    region: str | None = typer.Option(None, help="Every node of this region"),
    pool: str | None = typer.Option(None, help="Every node of this pool"),
    batch: str = typer.Option("1", help="Units at once: N, or N% of the units"),
    max_unavailable: str = typer.Option(
        "10%", help="Most of the scope's GPUs out of service at once (faults included)"
    ),
    max_failures: int = typer.Option(1, help="Failed nodes that pause the upgrade"),
    drain_wait: int = typer.Option(
        1800, help="Seconds work may take to reach its next checkpoint before the node drains"
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Start a rolling upgrade: a batch of units (a node, or an NVLink domain's nodes) at a
    time is drained, given the stack by its agents, burned in and returned to service.
    Follow it with `rackplane fleet upgrades ID`."""
    body = {
        "stack": stack,
        "region": region,
        "pool": pool,
        "batch": batch,
        "max_unavailable_pct": _pct(max_unavailable),
        "max_failures": max_failures,
        "drain_wait_s": drain_wait,
    }
    out = _stack_call(
        lambda s: upgrades.describe(
            s, upgrades.start(s, UpgradeCreate.model_validate(body), requested_by="cli")
        )
    )
    _upgrade_print(out, as_json)


@fleet_cli.command("upgrades")
def fleet_upgrades(
    upgrade_id: str | None = typer.Argument(None, help="One upgrade, node by node"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Upgrades, newest first; with an ID, its progress and report node by node."""
    if upgrade_id is None:
        rows = _stack_call(upgrades.list_all).items
        if as_json:
            print(json.dumps([r.model_dump(mode="json") for r in rows]))
            return
        table = Table("id", "stack", "scope", "state", "done/nodes", "failed", "GPU-h out")
        for r in rows:
            table.add_row(
                str(r.id),
                r.stack,
                f"{r.scope_kind} {r.scope}",
                r.state,
                f"{r.progress.done + r.progress.rolled_back}/{r.report.nodes}",
                str(r.progress.failed),
                f"{r.report.gpu_hours_out_of_service:.1f}",
            )
        console.print(table)
        return
    out = _stack_call(lambda s: upgrades.describe(s, upgrades.get(s, upgrade_id)))
    _upgrade_print(out, as_json)


@fleet_cli.command("upgrade-resume")
def fleet_upgrade_resume(upgrade_id: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """Resume a paused upgrade; its failed nodes are tried again."""
    out = _stack_call(
        lambda s: upgrades.describe(s, upgrades.resume(s, upgrades.get(s, upgrade_id, lock=True)))
    )
    _upgrade_print(out, as_json)


@fleet_cli.command("upgrade-rollback")
def fleet_upgrade_rollback(upgrade_id: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """Roll an upgrade back: every node it touched returns to the stack it ran before."""
    out = _stack_call(
        lambda s: upgrades.describe(s, upgrades.rollback(s, upgrades.get(s, upgrade_id, lock=True)))
    )
    _upgrade_print(out, as_json)


def _upgrade_print(out, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out.model_dump(mode="json")))
        return
    p, r = out.progress, out.report
    console.print(
        f"upgrade {out.id}: stack {out.stack} on {out.scope_kind} {out.scope}, "
        f"[bold]{out.state}[/bold]" + (f" ({out.state_reason})" if out.state_reason else "")
    )
    console.print(
        f"  {out.units_at_once} unit(s) at once, at most {out.max_unavailable_pct:g}% of GPUs "
        f"out; pauses at {out.max_failures} failure(s)"
    )
    console.print(
        f"  nodes: {p.done} done, {p.draining} draining, {p.applying} applying, "
        f"{p.pending} pending, {p.failed} failed, {p.skipped} skipped, "
        f"{p.rolled_back} rolled back"
    )
    console.print(
        f"  report: {r.gpu_hours_out_of_service:.2f} GPU-hours out of service, "
        f"{r.work_moved} workload(s) moved, {r.failures} failure(s)"
    )
    if out.nodes:
        table = Table("node", "unit", "phase", "from", "moved", "detail")
        for n in out.nodes:
            table.add_row(
                n.node, str(n.unit), n.phase, n.from_stack or "-", str(n.work_moved), n.detail or ""
            )
        console.print(table)


@fleet_cli.command("mig-layout")
def fleet_mig_layout(
    node: str = typer.Argument(..., help="The node's name"),
    gpu: int = typer.Argument(..., help="The GPU's index on the node"),
    profiles: str = typer.Argument(
        ..., help="Comma-separated profile names (3g.40gb,2g.20gb,1g.10gb...), or `whole`"
    ),
) -> None:
    """Lay a GPU out as these MIG instances (or a whole GPU) through its node's agent, while
    the GPU is idle; `rackplane fleet show` then lists the instances its agent made."""
    names = None if profiles == "whole" else [p for p in profiles.split(",") if p]

    def act(s):
        row = node_named(s, node)
        if row is None:
            fail(f"no node named {node}", 2)
        g = s.scalar(select(Gpu).where(Gpu.node_id == row.id, Gpu.index == gpu))
        if g is None:
            fail(f"node {node} has no GPU {gpu}", 2)
        return mig.request_on_gpu(s, g, MigLayoutIn(profiles=names), "operator")

    out = _stack_call(act)
    what = ", ".join(f"{x.profile}@{x.start}" for x in out.layout) or "whole GPU"
    console.print(f"GPU {gpu} of {node}: {what} asked of its agent ({out.status})")
