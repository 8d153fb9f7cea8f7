"""`rackplane bench serve`: a day of traffic against an endpoint under each autoscaling policy."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit, err
from rackplane_bench.serve import Day, Model, Setup, bench

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class ServeOptions:
    """`rackplane bench serve`'s options (their help is on bench_serve)."""

    day_s: float
    peak_rps: float
    burst_x: float
    slo_ms: float
    max_replicas: int
    cold_start_s: float
    token_ms: float | None
    batch_cost: float | None
    seed: int
    as_json: bool


@cli.command("serve")
def bench_serve(
    day_s: float = typer.Option(14_400.0, min=600, help="Simulated seconds the day lasts."),
    peak_rps: float = typer.Option(8.0, min=0.1, help="Requests a second at the peak."),
    burst_x: float = typer.Option(2.0, min=1, help="The burst, as a multiple of the peak."),
    slo_ms: float = typer.Option(8000.0, min=1, help="A request's latency objective (p95)."),
    max_replicas: int = typer.Option(8, min=1),
    cold_start_s: float = typer.Option(20.0, min=0, help="Placement, start and model load."),
    token_ms: float = typer.Option(
        None, help="A token's time in a batch of one (default: measured on examples/serve.py)."
    ),
    batch_cost: float = typer.Option(
        None, help="Extra per sequence in a batch (default: measured)."
    ),
    seed: int = typer.Option(20261129),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per policy."),
) -> None:
    """A day of traffic (night, ramp, burst, plateau, fall) against an endpoint whose replicas
    serve as examples/serve.py does, under each policy: `static-peak`, `qps` (SkyServe's) and
    `rackplane` (the controller's KPA): `slo_attainment`, `gpu_hours`, `cold_start_p50_s`,
    `training_goodput_lost_gpu_h`. See rackplane_bench/serve.py."""
    execute(
        ServeOptions(
            day_s=day_s,
            peak_rps=peak_rps,
            burst_x=burst_x,
            slo_ms=slo_ms,
            max_replicas=max_replicas,
            cold_start_s=cold_start_s,
            token_ms=token_ms,
            batch_cost=batch_cost,
            seed=seed,
            as_json=as_json,
        )
    )


def execute(opts: ServeOptions) -> None:
    """A JSON object (or a line) per policy; the token model measured unless given."""
    model = None
    if opts.token_ms is not None or opts.batch_cost is not None:
        model = Model(token_ms=opts.token_ms or 20.0, batch_cost=opts.batch_cost or 0.05)
    setup = Setup(
        slo_ms=opts.slo_ms, max_replicas=opts.max_replicas, cold_start_s=opts.cold_start_s
    )
    day = Day(day_s=opts.day_s, peak_rps=opts.peak_rps, burst_x=opts.burst_x)
    for doc in bench(day, setup, model, opts.seed, log=lambda line: err.print(line)):
        emit(doc, opts.as_json)
