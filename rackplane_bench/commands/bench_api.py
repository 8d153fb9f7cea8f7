"""`rackplane bench api`: CPU per request of the API's hot routes on a scratch database."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.deploy import median_of
from rackplane_bench.lifecycle import run_api

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class ApiOptions:
    """`rackplane bench api`'s options (their help is on bench_api)."""

    requests: int
    runs: int
    as_json: bool


@cli.command("api")
def bench_api(
    requests: int = typer.Option(1000, help="Requests per route and run."),
    runs: int = typer.Option(3, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """CPU per request of the API's hot routes (POST, GET, DELETE /v1/workloads), one at a
    time on one API process, with PostgreSQL's and the worker's CPU beside it, on a scratch
    database (see rackplane_bench/lifecycle.py)."""
    execute(ApiOptions(requests=requests, runs=runs, as_json=as_json))


def execute(opts: ApiOptions) -> None:
    emit(median_of([run_api(opts.requests) for _ in range(opts.runs)]), opts.as_json)
