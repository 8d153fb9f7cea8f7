"""`rackplane bench failover`: the HA topology under three tenants' load, its parts killed in
turn."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit, err
from rackplane_bench.failover import FAULTS, run
from rackplane_bench.ha import missing_engines

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class FailoverOptions:
    """`rackplane bench failover`'s options (their help is on bench_failover)."""

    faults: str
    rate: float
    gap: float
    as_json: bool


@cli.command("failover")
def bench_failover(
    faults: str = typer.Option(
        ",".join(FAULTS),
        help="Faults in turn: postgres_leader, worker, redis_master, api.",
    ),
    rate: float = typer.Option(2.0, help="Submissions per second per tenant (three tenants)."),
    gap: float = typer.Option(
        25.0, help="Seconds between faults (the killed part is back half way)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The HA topology (Patroni, Sentinel, two API processes, two workers, a beat) under
    three tenants' load, its parts killed with SIGKILL in turn; what was lost, doubled or
    refused, and how long each fault stopped writes (see rackplane_bench/failover.py)."""
    execute(FailoverOptions(faults=faults, rate=rate, gap=gap, as_json=as_json))


def execute(opts: FailoverOptions) -> None:
    """Exit 2 where the HA engines are missing; --faults must name known faults."""
    if missing_engines():
        err.print(f"[red]missing {', '.join(missing_engines())}: run scripts/ensure-ha.sh[/red]")
        raise typer.Exit(2)
    chosen = tuple(f.strip() for f in opts.faults.split(",") if f.strip())
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        raise typer.BadParameter(f"unknown faults: {', '.join(unknown)}", param_hint="--faults")
    emit(run(chosen, rate=opts.rate, gap=opts.gap), opts.as_json)
