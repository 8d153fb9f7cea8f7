"""`rackplane bench telemetry`: DCGM telemetry through the real API into PostgreSQL."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.telemetry import median_run

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class TelemetryOptions:
    """`rackplane bench telemetry`'s options (their help is on bench_telemetry)."""

    gpus: int
    rounds: int
    batch_nodes: int
    runs: int
    as_json: bool


@cli.command("telemetry")
def bench_telemetry(
    gpus: int = typer.Option(10_000, min=8, help="GPUs reporting (8 per node)."),
    rounds: int = typer.Option(12, min=1, help="Measured rounds (30 s of agent time each)."),
    batch_nodes: int = typer.Option(32, min=1, help="Nodes per push (a rack's relay)."),
    runs: int = typer.Option(1, min=1, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """DCGM telemetry through the real API into PostgreSQL: samples/s, API CPU and
    database writes per 1000 samples (see rackplane_bench/telemetry.py)."""
    execute(
        TelemetryOptions(
            gpus=gpus, rounds=rounds, batch_nodes=batch_nodes, runs=runs, as_json=as_json
        )
    )


def execute(opts: TelemetryOptions) -> None:
    result = median_run(opts.runs, gpus=opts.gpus, rounds=opts.rounds, batch_nodes=opts.batch_nodes)
    emit(result, opts.as_json)
