"""`rackplane bench graphql`: the portal's dashboard query and the operator's fleet query against
a real API process on a scratch database."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.graphql import run

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class GraphqlOptions:
    """`rackplane bench graphql`'s options (their help is on bench_graphql)."""

    workloads: int
    gpus: int
    requests: int
    as_json: bool


@cli.command("graphql")
def bench_graphql(
    workloads: int = typer.Option(10_000, help="The tenant's workloads."),
    gpus: int = typer.Option(10_000, help="Fleet size in GPUs (8 per node, two regions)."),
    requests: int = typer.Option(300, help="Timed queries of each kind (after a warm-up)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The portal's dashboard query and the operator's fleet query against a real API
    process on a scratch PostgreSQL database: p50/p99 latency and SQL statements per query
    (see rackplane_bench/graphql.py)."""
    execute(GraphqlOptions(workloads=workloads, gpus=gpus, requests=requests, as_json=as_json))


def execute(opts: GraphqlOptions) -> None:
    emit(run(opts.workloads, opts.gpus, opts.requests), opts.as_json)
