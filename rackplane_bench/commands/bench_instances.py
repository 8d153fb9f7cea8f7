"""`rackplane bench instances`: POST /v1/workloads to the first SSH login, for container and VM
instances on a real agent of this machine, then escapes tried from inside them."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit, err
from rackplane_bench.instances import Unavailable, bench

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class InstancesOptions:
    """`rackplane bench instances`'s options (their help is on bench_instances)."""

    launches: int
    as_json: bool


@cli.command("instances")
def bench_instances(
    launches: int = typer.Option(10, min=1, help="Instances of each runtime, one at a time."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Time from POST /v1/workloads to the first SSH login with the tenant's key, for
    container (podman) and VM instances on a real agent of this machine (root, podman, QEMU),
    p50 and p95; then the escapes of issue 44 §4 tried from inside them (`escapes`: those that
    worked). See rackplane_bench/instances.py."""
    execute(InstancesOptions(launches=launches, as_json=as_json))


def execute(opts: InstancesOptions) -> None:
    """Exit 2, saying why, where this machine cannot run it."""
    try:
        result = bench(launches=opts.launches, log=lambda line: err.print(line))
    except Unavailable as exc:
        err.print(f"instances cannot run here: {exc}")
        raise typer.Exit(2) from None
    emit(result, opts.as_json)
