"""`rackplane bench metering`: ledger ingestion rate and a month's finance export time on a
scratch database."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.metering import run

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class MeteringOptions:
    """`rackplane bench metering`'s options (their help is on bench_metering)."""

    events: int
    tenants: int
    intervals: int
    runs: int
    as_json: bool


@cli.command("metering")
def bench_metering(
    events: int = typer.Option(200_000, help="Ledger events to ingest per run."),
    tenants: int = typer.Option(10_000, help="Tenants in the export month."),
    intervals: int = typer.Option(1_000_000, help="Usage intervals in the export month."),
    runs: int = typer.Option(3, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Ledger ingestion rate and a month's finance export time, on a scratch PostgreSQL
    database (see rackplane_bench/metering.py)."""
    execute(
        MeteringOptions(
            events=events, tenants=tenants, intervals=intervals, runs=runs, as_json=as_json
        )
    )


def execute(opts: MeteringOptions) -> None:
    result = run(events=opts.events, tenants=opts.tenants, intervals=opts.intervals, runs=opts.runs)
    emit(result, opts.as_json)
