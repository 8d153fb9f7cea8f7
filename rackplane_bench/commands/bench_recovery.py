"""`rackplane bench recovery`: Xid 79 on one GPU of running 8x8 gangs, on a scratch deployment."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.recovery import run

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class RecoveryOptions:
    """`rackplane bench recovery`'s options (their help is on bench_recovery)."""

    gpus: int
    faults: int
    as_json: bool


@cli.command("recovery")
def bench_recovery(
    gpus: int = typer.Option(10_000, min=512, help="GPUs in the fleet (half get filled)."),
    faults: int = typer.Option(10, min=1, help="Gangs hit by an Xid 79, one at a time."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Xid 79 on one GPU of running 8x8 gangs: fault to requeued and to running again,
    lost work, usage after the fault, double allocations (see rackplane_bench/recovery.py)."""
    execute(RecoveryOptions(gpus=gpus, faults=faults, as_json=as_json))


def execute(opts: RecoveryOptions) -> None:
    emit(run(gpus=opts.gpus, faults=opts.faults), opts.as_json)
