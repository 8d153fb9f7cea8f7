"""`rackplane workloads ...`: read a workload from the server's shell, as the API shows it (its
state, where it runs and, for an instance or VM launched with SSH keys, how to log in)."""

from __future__ import annotations

import json
import uuid

import typer
from rich.markup import escape
from rich.table import Table
from sqlalchemy import select

from app.cli.common import console, fail
from app.core.db import get_or_404, session_scope
from app.core.errors import AppError
from app.models.tenants import Tenant
from app.models.workloads import State, Workload
from app.workloads.reads import attach_pending
from app.workloads.replies import WorkloadOut

workloads_cli = typer.Typer(
    help="Read workloads: one's state, placement and how to log in; the newest of them.",
    no_args_is_help=True,
)
MAX_LIMIT = 500  # as REST's page


def _nodes(out: WorkloadOut) -> list[str]:
    """The nodes its replicas hold GPUs on, each once, in replica order."""
    places = sorted(out.placement or [], key=lambda p: p.get("replica", 0))
    return list(dict.fromkeys(str(p["node"]) for p in places if p.get("node")))


def _document(out: WorkloadOut, tenant: str | None) -> dict:
    """The API's document (GET /v1/workloads/{id}), with the tenant's slug beside it."""
    return {"tenant": tenant, **out.model_dump(mode="json")}


def _login(out: WorkloadOut) -> str:
    c = out.connect
    if c is None:
        return "-"
    return escape(f"{c.command} ({'ready' if c.ready else 'booting'})")


def _restarts(out: WorkloadOut) -> str:
    """Its restarts by cause, against its policy's limit, and its back-off if it waits one."""
    p = out.restart_policy
    counted = sum(out.restarts.get(c, 0) for c in p.counts)
    by = ", ".join(f"{c} {n}" for c, n in sorted(out.restarts.items()) if n) or "none"
    text = f"{by}; {counted} of {p.max_restarts} counted (after {', '.join(p.on) or 'nothing'})"
    if out.not_before is not None:
        text += f"; backing off until {out.not_before:%Y-%m-%d %H:%M:%S}"
    return escape(text)


@workloads_cli.command("show")
def workloads_show(
    workload_id: str = typer.Argument(..., help="The workload's id."),
    as_json: bool = typer.Option(False, "--json", help="The API's document for it."),
) -> None:
    """One workload: its state, where it runs, and how to log in to it.

    State, kind, runtime, tier, the nodes it runs on and, for an instance or VM launched with SSH
    keys, the command to log in and whether its SSH server answers yet."""
    try:
        with session_scope() as session:
            w = get_or_404(session, Workload, workload_id, what="workload")
            tenant = session.scalar(select(Tenant.slug).where(Tenant.id == w.tenant_id))
            # `connect` and `pending` as the API works them out.
            out = WorkloadOut.model_validate(attach_pending(session, [w])[0])
    except AppError as exc:
        fail(escape(f"{exc.detail} ({exc.code})"), 2)
    if as_json:
        console.print_json(json.dumps(_document(out, tenant)))
        return
    nodes = _nodes(out)
    lines = [
        ("workload", f"{out.id}" + (f" ({escape(out.name)})" if out.name else "")),
        ("tenant", tenant or "-"),
        ("state", out.state),
        *(
            [("waits", escape(f"{out.pending.reason}: {out.pending.detail}"))]
            if out.pending
            else []
        ),
        ("kind", out.kind),
        ("runtime", out.runtime + (f" {escape(out.image)}" if out.image else "")),
        *([("workdir", escape(out.workdir))] if out.workdir else []),
        ("tier", out.tier),
        ("priority", out.priority),
        ("region", out.region or "-"),
        ("nodes", ", ".join(nodes) if nodes else "not placed"),
    ]
    if out.array is not None:
        a = out.array
        lines.append(
            ("array", f"element {a.index} of {a.count} ({a.max_parallel} at once), array {a.id}")
        )
    if out.elastic is not None:
        e = out.elastic
        lines.append(
            (
                "elastic",
                f"{e.current_replicas} of {out.replicas} replicas now "
                f"(goes on with at least {e.min_replicas})",
            )
        )
    if out.depends_on:
        lines.append(("depends on", ", ".join(str(i) for i in out.depends_on)))
    lines.append(("restarts", _restarts(out)))
    if out.secret_env:
        refs = ", ".join(f"{v} from secret {n}" for v, n in sorted(out.secret_env.items()))
        lines.append(("secret env", escape(refs)))
    if out.ssh_keys:
        lines.append(("ssh keys", str(len(out.ssh_keys))))
    c = out.connect
    if c is not None:
        lines.append(("connect", escape(c.command)))
        lines.append(
            ("ready", f"yes, since {c.ready_at:%Y-%m-%d %H:%M:%S}" if c.ready_at else "yes")
            if c.ready
            else ("ready", "no: booting (its SSH server has not answered yet)")
        )
    elif out.ssh_keys and out.state in ("succeeded", "failed", "terminated"):
        lines.append(("connect", f"none: it is {out.state}"))
    elif out.ssh_keys:
        lines.append(("connect", "not yet: its node's agent has not reported a port"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        console.print(f"{k + ':':<{width + 1}} {v}", highlight=False)


@workloads_cli.command("list")
def workloads_list(
    tenant: str | None = typer.Option(None, help="Only this tenant's (its slug)."),
    state: State | None = typer.Option(None, help="Only workloads in this state."),
    array: str | None = typer.Option(None, help="Only this job array's elements (its id)."),
    limit: int = typer.Option(50, min=1, max=MAX_LIMIT, help="How many, at most."),
    as_json: bool = typer.Option(False, "--json", help="The API's documents."),
) -> None:
    """Workloads, newest first (at most `--limit` of them).

    Each with its id, tenant, state, kind, runtime, tier, nodes, and the command to log in where
    there is one."""
    with session_scope() as session:
        stmt = select(Workload, Tenant.slug).join(Tenant, Tenant.id == Workload.tenant_id)
        if tenant is not None:
            tenant_id = session.scalar(select(Tenant.id).where(Tenant.slug == tenant))
            if tenant_id is None:
                fail(escape(f"no tenant {tenant}"), 2)
            stmt = stmt.where(Workload.tenant_id == tenant_id)
        if state is not None:
            stmt = stmt.where(Workload.state == state.value)
        if array is not None:
            try:
                stmt = stmt.where(Workload.array_id == uuid.UUID(array))
            except ValueError:
                fail(escape(f"no job array {array}: an array's id is a UUID"), 2)
        stmt = stmt.order_by(Workload.created_at.desc(), Workload.id.desc()).limit(limit)
        found = session.execute(stmt).all()
        attach_pending(session, [w for w, _ in found])
        rows = [(WorkloadOut.model_validate(w), slug) for w, slug in found]
    if as_json:
        console.print_json(json.dumps([_document(out, slug) for out, slug in rows]))
        return
    table = Table("ID", "NAME", "TENANT", "STATE", "KIND", "RUNTIME", "TIER", "NODES", "CONNECT")
    for out, slug in rows:
        table.add_row(
            str(out.id),
            escape((out.name or "") + (f"[{out.array.index}]" if out.array else "")),
            slug,
            out.state + (f" ({out.pending.reason})" if out.pending else ""),
            out.kind,
            out.runtime,
            out.tier,
            ", ".join(_nodes(out)) or "-",
            _login(out),
        )
    console.print(table if rows else "No workloads.")
