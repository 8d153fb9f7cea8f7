"""`rackplane bench placement`: placement speed at fleet scale on one core; or with --regions,
placement across worker and API processes on a scratch deployment; or with --variability, gangs
and the openb replay with 5 % of the GPUs slow."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import typer

from app.placement.policies import DEFAULT_POLICY
from rackplane_bench import placement as placement_bench
from rackplane_bench import regions as regions_bench
from rackplane_bench.commands.common import TRACES, emit, err, parse_seeds
from rackplane_bench.deploy import median_of
from rackplane_bench.sim import variability as variability_sim

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class PlacementOptions:
    """`rackplane bench placement`'s options (their help is on bench_placement)."""

    gpus: int
    placements: int
    gangs: int
    runs: int | None
    policy: str
    variability: bool
    nodes: int
    seeds: str
    openb_seeds: str
    regions: int | None
    workers: str
    api_processes: str
    backlog: int
    rate: float
    duration: float
    warmup: float
    as_json: bool


@cli.command("placement")
def bench_placement(
    gpus: int = typer.Option(100_000, help="Fleet size in GPUs."),
    placements: int = typer.Option(2000, help="Placements timed per kind."),
    gangs: int = typer.Option(100, help="64-GPU gangs timed."),
    runs: int | None = typer.Option(
        None,
        min=1,
        help="Repeats; the median of each figure is reported. Default 3; with --regions 1.",
    ),
    policy: str = typer.Option(DEFAULT_POLICY),
    variability: bool = typer.Option(
        False,
        "--variability",
        help="Instead: 5 % of GPUs 20 % slow; gangs on slow GPUs (aware vs blind) and the "
        "openb replay's allocation with them marked (see rackplane_bench/sim/variability.py).",
    ),
    nodes: int = typer.Option(1024, help="--variability: HGX nodes of the gang fleet."),
    seeds: str = typer.Option("1-5", help="--variability: seeds of the gang runs."),
    openb_seeds: str = typer.Option("42-51", help="--variability: seeds of the openb replays."),
    regions: int | None = typer.Option(
        None,
        min=1,
        help="Instead: placement across processes on a scratch deployment with this many "
        "regions (see rackplane_bench/regions.py).",
    ),
    workers: str = typer.Option("1,2", help="--regions: worker processes, a comma list."),
    api_processes: str = typer.Option("1,2", help="--regions: API processes, a comma list."),
    backlog: int = typer.Option(200, min=1, help="--regions: queued workloads per region."),
    rate: float = typer.Option(100.0, help="--regions: submissions per second (open loop)."),
    duration: float = typer.Option(10.0, help="--regions: seconds of load measured."),
    warmup: float = typer.Option(3.0, help="--regions: seconds of load first, not measured."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Placement speed at fleet scale on one core (see rackplane_bench/placement.py), or with
    --regions across worker and API processes."""
    execute(
        PlacementOptions(
            gpus=gpus,
            placements=placements,
            gangs=gangs,
            runs=runs,
            policy=policy,
            variability=variability,
            nodes=nodes,
            seeds=seeds,
            openb_seeds=openb_seeds,
            regions=regions,
            workers=workers,
            api_processes=api_processes,
            backlog=backlog,
            rate=rate,
            duration=duration,
            warmup=warmup,
            as_json=as_json,
        )
    )


def execute(opts: PlacementOptions) -> None:
    """--variability, --regions, or else the median of --runs timings on one core."""
    if opts.variability:
        _variability(opts)
        return
    if opts.regions is not None:
        _regions(opts.regions, opts)
        return
    runs = opts.runs or 3
    results = [
        placement_bench.run(
            opts.gpus, placements=opts.placements, gangs=opts.gangs, seed=i, policy=opts.policy
        ).as_dict()
        for i in range(runs)
    ]
    median = {
        k: (
            statistics.median(r[k] for r in results)
            if isinstance(results[0][k], (int, float))
            else results[0][k]
        )
        for k in results[0]
    }
    median["runs"] = runs
    emit(median, opts.as_json)


def _regions(regions: int, opts: PlacementOptions) -> None:
    """Each configuration (workers, API processes) once per run, in turn (so a slower hour
    weighs on all of them alike); then one line per configuration, medians of the runs, with
    its ratios to the first configuration's."""
    configs = [
        (int(w), int(a)) for w in opts.workers.split(",") for a in opts.api_processes.split(",")
    ]
    runs = opts.runs or 1
    results: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for i in range(runs):
        for w, a in configs:
            r = regions_bench.run(
                regions, w, a, opts.backlog, opts.rate, opts.duration, opts.warmup
            )
            err.print(
                f"run {i + 1}/{runs}, {w} worker(s), {a} API process(es): "
                f"placed/s {r['placed_per_s']}, p99 {r['submit_to_placed_p99_ms']} ms, "
                f"others' CPU {r['load_cpu_pct_other']} / {r['place_cpu_pct_other']} %"
            )
            results[(w, a)].append(r)
    base = median_of(results[configs[0]])
    for c in configs:
        out = median_of(results[c])
        out["baseline"] = f"workers={configs[0][0]} api_processes={configs[0][1]}"
        out["placed_per_s_ratio"] = round(out["placed_per_s"] / base["placed_per_s"], 2)
        out["submit_to_placed_p99_ratio"] = round(
            out["submit_to_placed_p99_ms"] / base["submit_to_placed_p99_ms"], 2
        )
        emit(out, opts.as_json)


def _variability(opts: PlacementOptions) -> None:
    """Gangs on slow GPUs with the placer aware of them and blind to them, over --seeds; then
    the openb replay's allocation with the slow GPUs marked, over --openb-seeds."""
    seeds, openb_seeds = parse_seeds(0, opts.seeds), parse_seeds(0, opts.openb_seeds)
    runs = [variability_sim.gangs(opts.nodes, seed, opts.policy) for seed in seeds]
    aware = sum(r["gangs_on_slow_pct_aware"] * r["gangs_placed_aware"] for r in runs)
    blind = sum(r["gangs_on_slow_pct_blind"] * r["gangs_placed_blind"] for r in runs)
    out = {
        "nodes": opts.nodes,
        "seeds": seeds,
        "gangs_placed": sum(r["gangs_placed_aware"] for r in runs),
        "gangs_on_slow_pct_aware": round(
            aware / max(1, sum(r["gangs_placed_aware"] for r in runs)), 2
        ),
        "gangs_on_slow_pct_blind": round(
            blind / max(1, sum(r["gangs_placed_blind"] for r in runs)), 2
        ),
        "per_seed": runs,
    }
    if openb_seeds:
        out["openb"] = variability_sim.openb(
            TRACES / "openb" / "openb_node_list_gpu_node.csv",
            TRACES / "openb" / "openb_pod_list_default.csv",
            openb_seeds,
            opts.policy,
        )
    emit(out, opts.as_json)
