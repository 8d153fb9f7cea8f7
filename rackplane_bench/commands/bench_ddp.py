"""`rackplane bench ddp`: a DDP job across hosts made of network namespaces, one host lost after
a checkpoint, again and again."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit, err
from rackplane_bench.ddp import Unavailable, bench

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class DdpOptions:
    """`rackplane bench ddp`'s options (their help is on bench_ddp)."""

    hosts: int
    runs: int
    as_json: bool


@cli.command("ddp")
def bench_ddp(
    hosts: int = typer.Option(4, min=3, help="Hosts (network namespaces); one is a spare."),
    runs: int = typer.Option(3, min=1, help="Lost hosts per mode (fixed-size, elastic)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A DDP job (examples/ddp_train.py, Gloo) across hosts made of network namespaces, each
    with its own agent; one host lost after a checkpoint, again and again: `detect_s` (loss to
    the control plane acting), `resume_s_fixed` / `resume_s_elastic` (loss to training stepping
    again), `steps_lost`, p50 and p95. Needs root, iproute2 and .venv-train (make
    train-engines). See rackplane_bench/ddp.py."""
    execute(DdpOptions(hosts=hosts, runs=runs, as_json=as_json))


def execute(opts: DdpOptions) -> None:
    """Exit 2, saying why, where this machine cannot run it."""
    try:
        result = bench(hosts=opts.hosts, runs=opts.runs, log=lambda line: err.print(line))
    except Unavailable as exc:
        err.print(f"ddp cannot run here: {exc}")
        raise typer.Exit(2) from None
    emit(result, opts.as_json)
