"""`rackplane bench lifecycle`: submit-to-placed latency through the whole stack on a scratch
database, for each worker count asked for."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.deploy import median_of
from rackplane_bench.lifecycle import run

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class LifecycleOptions:
    """`rackplane bench lifecycle`'s options (their help is on bench_lifecycle)."""

    workers: str
    rate: float
    duration: float
    runs: int
    churn: bool
    warmup: float
    concurrency: int
    as_json: bool


@cli.command("lifecycle")
def bench_lifecycle(
    workers: str = typer.Option("1", help="Worker processes; a comma list runs each in turn."),
    rate: float = typer.Option(100.0, help="Submissions per second (open loop)."),
    duration: float = typer.Option(20.0, help="Seconds of load."),
    runs: int = typer.Option(1, help="Repeats per worker count; medians are reported."),
    churn: bool = typer.Option(
        True, help="Terminate each workload through the API a second after it runs."
    ),
    warmup: float = typer.Option(5.0, help="Seconds of the same load first, not measured."),
    concurrency: int = typer.Option(
        1, help="Pool processes of each worker (tasks it runs at once)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Submit-to-placed latency through API, outbox, Redis, Celery workers and PostgreSQL, on
    a scratch database (see rackplane_bench/lifecycle.py)."""
    execute(
        LifecycleOptions(
            workers=workers,
            rate=rate,
            duration=duration,
            runs=runs,
            churn=churn,
            warmup=warmup,
            concurrency=concurrency,
            as_json=as_json,
        )
    )


def execute(opts: LifecycleOptions) -> None:
    """The medians of --runs runs, a line per worker count."""
    for n in [int(x) for x in opts.workers.split(",")]:
        results = [
            run(n, opts.rate, opts.duration, opts.churn, opts.warmup, opts.concurrency)
            for _ in range(opts.runs)
        ]
        emit(median_of(results), opts.as_json)
