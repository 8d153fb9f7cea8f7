"""`rackplane billing ...`: exports for finance, Stripe meter events, reconciliation."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import typer
from rich.table import Table

from app.billing import exports
from app.cli.common import console, err, fail
from app.core.db import session_scope
from app.core.errors import AppError
from app.tenancy.principal import SYSTEM

billing_cli = typer.Typer(
    help="Exports, Stripe meter events, reconciliation.", no_args_is_help=True
)


@billing_cli.command("export")
def billing_export(
    period: str = typer.Option(..., help="The month, e.g. 2026-11."),
    format: str = typer.Option("csv", help="csv or jsonl."),
    output: Path | None = typer.Option(None, "--output", "-o", help="File (default: stdout)."),
) -> None:
    """Every tenant's month for finance: one row per day, tenant, SKU, tier, region, plan and
    price version (the same rows as GET /v1/billing/exports with an operator key)."""
    if format not in exports.FORMATS:
        fail(f"format must be one of {', '.join(exports.FORMATS)}", 2)
    try:
        with session_scope() as session:
            rows = exports.export_rows(session, SYSTEM, period)
    except AppError as exc:
        fail(exc.detail or exc.title, 2)
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
    # Deferred: the Stripe SDK (~110 ms) is for push and reconcile alone, not every command.
    from app.billing import stripe_export, stripe_gateway

    if stripe_gateway.gateway() is None:
        fail("Stripe is not configured (set RACKPLANE_STRIPE_API_KEY)", 2)
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
    # Deferred: the Stripe SDK (~110 ms) is for push and reconcile alone, not every command.
    from app.billing import stripe_export

    try:
        with session_scope() as session:
            report = stripe_export.reconcile(session, SYSTEM, period)
    except AppError as exc:
        fail(exc.detail or exc.title, 2)
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
