"""`rackplane sim ...` and `rackplane bench placement`: trace replays and speed benchmarks."""

from __future__ import annotations

import json
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from app.placement.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:
    from app.placement.queueing import QueueConfig

sim_cli = typer.Typer(
    help="Replay public GPU-cluster traces through the placement engine.", no_args_is_help=True
)
bench_cli = typer.Typer(help="Benchmarks: placement, lifecycle, metering.", no_args_is_help=True)
err = Console(stderr=True)
TRACES = Path(__file__).resolve().parents[3].parent / "shared" / "traces"


def _seeds(seed: int, seeds: str | None) -> list[int]:
    if not seeds:
        return [seed]
    out: list[int] = []
    for part in seeds.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _one(args: tuple[str, str, str, int, bool]) -> dict:
    from app.placement.sim import openb

    nodes_file, pods_file, policy, seed, bound = args
    nodes = openb.load_nodes(Path(nodes_file))
    pods = openb.load_pods(Path(pods_file))
    result = openb.replay(nodes, pods, policy, seed).as_dict()
    result["pods_file"] = Path(pods_file).name
    if bound:
        b = openb.physical_bound(nodes, pods, seed)
        result["bound_pct_at_130"] = round(b.pct, 4)
        result["offline_bound_pct_at_130"] = round(b.offline_pct, 4)
        result["bound_first_drop_pct"] = (
            None if b.first_drop_pct is None else round(b.first_drop_pct, 2)
        )
        result["bound_converged"] = b.converged
    return result


@sim_cli.command("openb")
def openb_cmd(
    nodes: Path = typer.Option(
        TRACES / "openb" / "openb_node_list_gpu_node.csv", exists=True, help="Node list CSV."
    ),
    pods: Path = typer.Option(
        TRACES / "openb" / "openb_pod_list_default.csv", exists=True, help="Pod list CSV."
    ),
    policy: str = typer.Option(DEFAULT_POLICY, help=f"One of: {', '.join(POLICIES)}."),
    seed: int = typer.Option(42, help="Shuffle and sampling seed."),
    seeds: str | None = typer.Option(
        None, help="Seed ranges, e.g. 42-51: runs each, then the mean."
    ),
    jobs: int = typer.Option(1, help="Runs in parallel (processes)."),
    bound: bool = typer.Option(
        False, help="Also compute the upper bound any policy could reach per run (LPs)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per run (and the mean)."),
) -> None:
    """The openb replay under the published FGD protocol (shared/traces/README.md)."""
    if policy not in POLICIES:
        err.print(f"[red]unknown policy {policy!r}[/red]; known: {', '.join(POLICIES)}")
        raise typer.Exit(2)
    runs = [(str(nodes), str(pods), policy, s, bound) for s in _seeds(seed, seeds)]
    results: list[dict] = []
    show = sys.stderr.isatty()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=err,
        disable=not show,
    ) as progress:
        task = progress.add_task(f"openb {pods.name} {policy}", total=len(runs))
        if jobs > 1 and len(runs) > 1:
            with ProcessPoolExecutor(jobs) as pool:
                for r in pool.map(_one, runs):
                    results.append(r)
                    _emit(r, as_json)
                    progress.advance(task)
        else:
            for run in runs:
                r = _one(run)
                results.append(r)
                _emit(r, as_json)
                progress.advance(task)
    if len(results) > 1:
        keys = ["alloc_pct_at_130", "frag_ratio_at_90", "placed", "dropped", "seconds"]
        if bound:
            keys += ["bound_pct_at_130", "offline_bound_pct_at_130"]
        mean = {
            "policy": policy,
            "pods_file": pods.name,
            "seeds": [r["seed"] for r in results],
            **{f"mean_{k}": round(statistics.fmean(r[k] for r in results), 4) for k in keys},
            "stdev_alloc_pct_at_130": round(
                statistics.pstdev(r["alloc_pct_at_130"] for r in results), 4
            ),
        }
        _emit(mean, as_json)


def _emit(obj: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj), flush=True)
    else:
        print("  ".join(f"{k}={v}" for k, v in obj.items()), flush=True)


@bench_cli.command("placement")
def bench_placement(
    gpus: int = typer.Option(100_000, help="Fleet size in GPUs."),
    placements: int = typer.Option(2000, help="Placements timed per kind."),
    gangs: int = typer.Option(100, help="64-GPU gangs timed."),
    runs: int = typer.Option(3, help="Repeats; the median of each figure is reported."),
    policy: str = typer.Option(DEFAULT_POLICY),
    variability: bool = typer.Option(
        False,
        "--variability",
        help="Instead: 5 % of GPUs 20 % slow; gangs on slow GPUs (aware vs blind) and the "
        "openb replay's allocation with them marked (see app/placement/sim/variability.py).",
    ),
    nodes: int = typer.Option(1024, help="--variability: HGX nodes of the gang fleet."),
    seeds: str = typer.Option("1-5", help="--variability: seeds of the gang runs."),
    openb_seeds: str = typer.Option("42-51", help="--variability: seeds of the openb replays."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Placement speed at fleet scale on one core (see app/placement/sim/bench.py)."""
    if variability:
        _variability(nodes, _seeds(0, seeds), _seeds(0, openb_seeds), policy, as_json)
        return
    from app.placement.sim.bench import run

    results = [
        run(gpus, placements=placements, gangs=gangs, seed=i, policy=policy).as_dict()
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
    _emit(median, as_json)


def _variability(
    nodes: int, seeds: list[int], openb_seeds: list[int], policy: str, as_json: bool
) -> None:
    from app.placement.sim import variability as v

    runs = [v.gangs(nodes, seed, policy) for seed in seeds]
    aware = sum(r["gangs_on_slow_pct_aware"] * r["gangs_placed_aware"] for r in runs)
    blind = sum(r["gangs_on_slow_pct_blind"] * r["gangs_placed_blind"] for r in runs)
    out = {
        "nodes": nodes,
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
        out["openb"] = v.openb(
            TRACES / "openb" / "openb_node_list_gpu_node.csv",
            TRACES / "openb" / "openb_pod_list_default.csv",
            openb_seeds,
            policy,
        )
    _emit(out, as_json)


# The reference baselines: the others are compared with fifo, and --share-cap leaves these as
# they are.
REFERENCES = ("fifo", "priority")


def _share_cap(text: str) -> float | None:
    """--share-cap's value: None for 'none', else a finite number >= 1."""
    if text.strip().lower() == "none":
        return None
    try:
        cap = float(text)
    except ValueError:
        cap = math.nan
    if not (math.isfinite(cap) and cap >= 1):
        err.print(f"[red]--share-cap is a finite number >= 1 or 'none', not {text!r}[/red]")
        raise typer.Exit(2)
    return cap


def _philly_one(args: tuple[str, str | None, float, int, str, QueueConfig]) -> dict:
    from app.placement.sim import philly

    jobs_file, window, scale, nodes, policy, config = args
    jobs = philly.load_jobs(Path(jobs_file), philly.parse_window(window), scale)
    tenants = philly.quotas(jobs, nodes * philly.GPUS_PER_NODE)
    out = philly.replay(jobs, nodes, policy, tenants, config).as_dict()
    out.update(window=window or "all", scale=scale, nodes=nodes)
    return out


@sim_cli.command("philly")
def philly_cmd(
    jobs_file: Path = typer.Option(
        TRACES / "philly" / "philly_jobs.csv", "--jobs", exists=True, help="Philly jobs CSV."
    ),
    policy: str = typer.Option(
        "fifo,priority,default",
        help="Queueing policies, comma-separated; all replay the same jobs in this run.",
    ),
    nodes: int = typer.Option(64, help="8-GPU nodes in the fleet (racks of 8)."),
    window: str | None = typer.Option(
        None, help="START:END in days from the first arrival, e.g. 14:42 (default: all)."
    ),
    scale: float = typer.Option(1.0, help="Divide arrival times by this (compresses time)."),
    parallel: int = typer.Option(1, help="Policies replayed in parallel (processes)."),
    share_cap: str | None = typer.Option(
        None,
        help="Fair-share ceiling for every policy but fifo and priority: a number >= 1, or "
        "'none' for none (default: each policy's own).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per policy, then a summary."
    ),
) -> None:
    """Replay Philly jobs through the queueing core; compare policies on the same input."""
    from app.placement.queueing import BASELINES

    names = [p.strip() for p in policy.split(",") if p.strip()]
    unknown = [p for p in names if p not in BASELINES]
    if unknown or not names:
        err.print(f"[red]unknown policy {unknown}[/red]; known: {', '.join(BASELINES)}")
        raise typer.Exit(2)
    if scale <= 0:
        err.print("[red]--scale must be positive[/red]")
        raise typer.Exit(2)
    configs = {p: BASELINES[p] for p in names}
    if share_cap is not None:
        cap = _share_cap(share_cap)
        if all(p in REFERENCES for p in names):
            err.print("[yellow]--share-cap leaves fifo and priority as they are[/yellow]")
        for p in names:
            if p not in REFERENCES:
                configs[p] = replace(configs[p], share_cap=cap)
    runs = [(str(jobs_file), window, scale, nodes, p, configs[p]) for p in names]
    if parallel > 1 and len(runs) > 1:
        with ProcessPoolExecutor(min(parallel, len(runs))) as pool:
            results = list(pool.map(_philly_one, runs))
    else:
        results = [_philly_one(r) for r in runs]
    by = {r["policy"]: r for r in results}
    for r in results:
        _emit(r, as_json)
    f = by.get("fifo")
    for name in names:
        if f is None or name in REFERENCES:
            continue
        d = by[name]
        summary = {
            "summary": f"{name} vs fifo",
            "share_cap": d["share_cap"],
            "jct_ratio": round(d["mean_jct_s"] / f["mean_jct_s"], 4) if f["mean_jct_s"] else None,
            "utilisation_delta": round(d["utilisation"] - f["utilisation"], 4),
            # The same without the GPU time that evictions threw away.
            "useful_utilisation_delta": round(d["useful_utilisation"] - f["useful_utilisation"], 4),
            "targets": {
                "mean_jct_at_most_0.7x_fifo": bool(
                    f["mean_jct_s"] and d["mean_jct_s"] <= 0.7 * f["mean_jct_s"]
                ),
                "utilisation_not_below_fifo": d["utilisation"] >= f["utilisation"],
                "big_gang_wait_at_most_3x_runtime": d["max_big_gang_wait_over_runtime"] <= 3,
                "tenant_share_within_10pct": d["max_share_deviation"] <= 0.10,
            },
        }
        _emit(summary, as_json)


@bench_cli.command("lifecycle")
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
    a scratch database (see app/workloads/bench.py)."""
    from app.workloads.bench import median_of, run

    for n in [int(x) for x in workers.split(",")]:
        results = [run(n, rate, duration, churn, warmup, concurrency) for _ in range(runs)]
        _emit(median_of(results), as_json)


@bench_cli.command("api")
def bench_api(
    requests: int = typer.Option(1000, help="Requests per route and run."),
    runs: int = typer.Option(3, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """CPU per request of the API's hot routes (POST, GET, DELETE /v1/workloads), one at a
    time on one API process, with PostgreSQL's and the worker's CPU beside it, on a scratch
    database (see app/workloads/bench.py)."""
    from app.workloads.bench import median_of, run_api

    _emit(median_of([run_api(requests) for _ in range(runs)]), as_json)
