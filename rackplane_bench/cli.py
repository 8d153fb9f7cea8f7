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
from rackplane_bench.failover import FAULTS as FAILOVER_FAULTS

if TYPE_CHECKING:
    from app.placement.queueing import QueueConfig

sim_cli = typer.Typer(
    help="Replay public GPU-cluster traces through the placement engine.", no_args_is_help=True
)
bench_cli = typer.Typer(help="Benchmarks: placement, lifecycle, metering.", no_args_is_help=True)
err = Console(stderr=True)
TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def _seeds(seed: int, seeds: str | None) -> list[int]:
    if not seeds:
        return [seed]
    out: list[int] = []
    for part in seeds.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _one(args: tuple[str, str, str, int, bool, int]) -> dict:
    from rackplane_bench.sim import openb

    nodes_file, pods_file, policy, seed, bound, stacks = args
    nodes = openb.with_stacks(openb.load_nodes(Path(nodes_file)), stacks)
    pods = openb.load_pods(Path(pods_file))
    result = openb.replay(nodes, pods, policy, seed).as_dict()
    result["pods_file"] = Path(pods_file).name
    if stacks > 1:
        result["stacks"] = stacks
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
    stacks: int = typer.Option(
        1, min=1, max=64, help="Software stacks the nodes take turns at running (1: none)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per run (and the mean)."),
) -> None:
    """The openb replay under the published FGD protocol (shared/traces/README.md)."""
    if policy not in POLICIES:
        err.print(f"[red]unknown policy {policy!r}[/red]; known: {', '.join(POLICIES)}")
        raise typer.Exit(2)
    runs = [(str(nodes), str(pods), policy, s, bound, stacks) for s in _seeds(seed, seeds)]
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
    if variability:
        _variability(nodes, _seeds(0, seeds), _seeds(0, openb_seeds), policy, as_json)
        return
    if regions is not None:
        configs = [(int(w), int(a)) for w in workers.split(",") for a in api_processes.split(",")]
        _regions(regions, configs, backlog, rate, duration, warmup, runs or 1, as_json)
        return
    from rackplane_bench.placement import run

    runs = runs or 3
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


def _regions(
    regions: int,
    configs: list[tuple[int, int]],
    backlog: int,
    rate: float,
    duration: float,
    warmup: float,
    runs: int,
    as_json: bool,
) -> None:
    """Each configuration (workers, API processes) once per run, in turn (so a slower hour
    weighs on all of them alike); then one line per configuration, medians of the runs, with
    its ratios to the first configuration's."""
    from rackplane_bench.deploy import median_of
    from rackplane_bench.regions import run

    results: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for i in range(runs):
        for w, a in configs:
            r = run(regions, w, a, backlog, rate, duration, warmup)
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
        _emit(out, as_json)


def _variability(
    nodes: int, seeds: list[int], openb_seeds: list[int], policy: str, as_json: bool
) -> None:
    from rackplane_bench.sim import variability as v

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


def _philly_one(args: tuple[str, str | None, float, int, str, QueueConfig, int]) -> dict:
    from rackplane_bench.sim import philly

    jobs_file, window, scale, nodes, policy, config, stacks = args
    jobs = philly.load_jobs(Path(jobs_file), philly.parse_window(window), scale)
    tenants = philly.quotas(jobs, nodes * philly.GPUS_PER_NODE)
    out = philly.replay(jobs, nodes, policy, tenants, config, stacks).as_dict()
    out.update(window=window or "all", scale=scale, nodes=nodes, stacks=stacks)
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
    stacks: int = typer.Option(
        1, min=1, max=64, help="Software stacks the racks take turns at running (1: none)."
    ),
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
    runs = [(str(jobs_file), window, scale, nodes, p, configs[p], stacks) for p in names]
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


def _faults_one(args: tuple) -> dict:
    from rackplane_bench.sim import faults

    params, policy, jobs_file = args
    fs = faults.draw_faults(params)
    bg = faults.background_jobs(params, Path(jobs_file)) if jobs_file else []
    return faults.replay(params, policy, fs, bg).as_dict()


@sim_cli.command("faults")
def faults_cmd(
    gpus: str = typer.Option(
        "16384", help="Fleet size in GPUs (8 per node); a comma list sweeps fleet sizes."
    ),
    days: float = typer.Option(54.0, help="Days replayed."),
    policy: str = typer.Option(
        "manual,requeue,default", help="Recovery policies, comma-separated; same faults for all."
    ),
    seed: int = typer.Option(1, help="Seeds the faults (and nothing else)."),
    faults_per_gpu_day: float = typer.Option(
        419 / (54 * 16_384), help="Unexpected interruptions per GPU-day (default: Llama 3's)."
    ),
    checkpoint_every: float = typer.Option(
        1800.0, help="The job's own checkpoint interval in seconds (manual, requeue)."
    ),
    checkpoint_cost: float = typer.Option(2.0, help="Seconds the job stalls per checkpoint."),
    restart: float = typer.Option(65.0, help="Seconds to relaunch the job on warm nodes."),
    provision: float = typer.Option(285.0, help="Extra seconds when a cold node joins."),
    detect: float = typer.Option(15.0, help="Seconds for telemetry to show a fault."),
    hang_timeout: float = typer.Option(600.0, help="Collective watchdog timeout (seconds)."),
    stall_detect: float = typer.Option(
        60.0, help="default: seconds without a step report that make a hang."
    ),
    human: float = typer.Option(1800.0, help="manual: seconds until a human acts."),
    hot_spares: int | None = typer.Option(
        None,
        help="default: warm spare nodes held for the job (default: the P99 of the job's daily "
        "node failures, at most a third of the spare pool).",
    ),
    spare_share: float = typer.Option(0.02, help="Share of the nodes kept out of the job."),
    warned: float = typer.Option(
        0.0, help="Share of hardware faults announced by a watch-level signal hours before."
    ),
    background_load: float = typer.Option(
        0.6, help="Background demand over the spare pool's GPUs (0: no background jobs)."
    ),
    jobs_file: Path = typer.Option(
        TRACES / "philly" / "philly_jobs.csv", "--jobs", help="Philly jobs CSV (background)."
    ),
    parallel: int = typer.Option(2, help="Replays run at once (processes)."),
    plot: Path | None = typer.Option(
        None, help="With several --gpus: write effective training time by fleet size (PNG)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per replay, then a summary."
    ),
) -> None:
    """Replay a large training job and background work under hardware faults drawn at
    published rates; compare recovery policies on the same faults
    (rackplane_bench/sim/faults.py)."""
    import time as _time

    from rackplane_bench.sim import faults

    names = [p.strip() for p in policy.split(",") if p.strip()]
    bad = [p for p in names if p not in faults.POLICIES]
    if bad or not names:
        err.print(f"[red]unknown policy {bad}[/red]; known: {', '.join(faults.POLICIES)}")
        raise typer.Exit(2)
    try:
        sizes = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(g < 64 for g in sizes) or days <= 0:
        err.print("[red]--gpus takes fleet sizes of at least 64 GPUs; --days is positive[/red]")
        raise typer.Exit(2)
    if background_load > 0 and not jobs_file.exists():
        err.print(f"[red]no background trace at {jobs_file}[/red] (or --background-load 0)")
        raise typer.Exit(2)
    causes = tuple(
        c if c.detect == "crash" or c.rule is None else replace(c, warned=warned)
        for c in faults.LLAMA3
    )
    base = faults.Params(
        days=days,
        seed=seed,
        faults_per_gpu_day=faults_per_gpu_day,
        spare_share=spare_share,
        hot_spares=hot_spares,
        checkpoint_every_s=checkpoint_every,
        checkpoint_cost_s=checkpoint_cost,
        restart_s=restart,
        provision_s=provision,
        detect_s=detect,
        hang_timeout_s=hang_timeout,
        stall_detect_s=stall_detect,
        human_s=human,
        background_load=background_load,
        causes=causes,
    )
    trace = str(jobs_file) if background_load > 0 else None
    runs = [(replace(base, gpus=g), p, trace) for g in sizes for p in names]
    start = _time.perf_counter()
    if parallel > 1 and len(runs) > 1:
        with ProcessPoolExecutor(min(parallel, len(runs))) as pool:
            results = list(pool.map(_faults_one, runs))
    else:
        results = [_faults_one(r) for r in runs]
    wall = _time.perf_counter() - start
    for r in results:
        if not as_json:
            _faults_table(r)
        else:
            _emit(r, as_json)
    by = {(r["gpus"], r["policy"]): r for r in results}
    for g in sizes:
        d = by.get((g, "default"))
        summary: dict = {
            "summary": "sim faults",
            "gpus": g,
            "days": days,
            "effective_training_time": {p: by[(g, p)]["effective_training_time"] for p in names},
            "replay_seconds": {p: by[(g, p)]["seconds"] for p in names},
        }
        if d is not None and g == 16_384 and days == 54:
            summary["targets"] = {
                "default_ett_at_least_0.97": d["effective_training_time"] >= 0.97,
                "replay_under_300s": d["seconds"] < 300,
            }
        _emit(summary, as_json)
    if not as_json:
        err.print(f"{len(runs)} replays in {wall:.0f} s")
    if plot is not None:
        _faults_plot(results, names, plot)


def _faults_table(r: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{r['policy']}: {r['gpus']:,} GPUs, {r['days']:g} days", show_header=False)
    t.add_row("effective training time", f"{r['effective_training_time']:.2%}")
    t.add_row("goodput GPU-hours", f"{r['goodput_gpu_hours']:,.0f}")
    for k, v in r["lost_gpu_hours"].items():
        t.add_row(f"lost GPU-hours: {k}", f"{v:,.0f}")
    t.add_row("checkpoint GPU-hours", f"{r['checkpoint_gpu_hours']:,.0f}")
    t.add_row("interruptions", str(r["interruptions"]))
    t.add_row("MTTR p50 / p99 (s)", f"{r['mttr_s']['p50']:g} / {r['mttr_s']['p99']:g}")
    t.add_row("background mean JCT (s)", f"{r['background']['mean_jct_s']:,.0f}")
    t.add_row("replay seconds", f"{r['seconds']:g}")
    Console().print(t)


def _faults_plot(results: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p in names:
        pts = sorted((r["gpus"], r["effective_training_time"]) for r in results if r["policy"] == p)
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fleet size (GPUs), same per-GPU fault rate")
    ax.set_ylabel("effective training time (%)")
    ax.axhline(97, color="grey", linestyle=":", linewidth=1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("rackplane sim faults: the big job's effective training time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    err.print(f"plot written to {path}")


def _upgrade_one(args: tuple) -> dict:
    from rackplane_bench.sim import philly, upgrade

    jobs_file, window, scale, nodes, policy, ckpt, params = args
    jobs = philly.load_jobs(Path(jobs_file), philly.parse_window(window), scale)
    jobs = upgrade.with_checkpoints(jobs, ckpt)
    tenants = philly.quotas(jobs, nodes * philly.GPUS_PER_NODE)
    r = upgrade.replay(jobs, nodes, tenants, params, policy)
    # What the summary needs, not the whole timeline (it crosses a process boundary).
    r.moves, r.unit_log = [], []
    return {"result": r}


@sim_cli.command("upgrade")
def upgrade_cmd(
    jobs_file: Path = typer.Option(
        TRACES / "philly" / "philly_jobs.csv", "--jobs", exists=True, help="Philly jobs CSV."
    ),
    nodes: int = typer.Option(128, min=2, help="8-GPU nodes in the fleet (racks of 8): the scope."),
    window: str = typer.Option("28:43", help="START:END in days of the Philly trace replayed."),
    scale: float | None = typer.Option(
        None,
        help="Divide arrival times by this (default: nodes/64, the load per GPU of the 64-node "
        "Philly replay).",
    ),
    start_day: float = typer.Option(
        0.5, help="Days after the first (scaled) arrival that the upgrade starts."
    ),
    batch: str = typer.Option(
        "1,1%,5%,10%,25%", help="Units upgraded at once, comma-separated: counts or N% of units."
    ),
    max_unavailable: str = typer.Option(
        "100%", help="Share of the scope's GPUs that may be out of service at once."
    ),
    drain_wait: float = typer.Option(1800.0, help="Cap of a node's drain deadline (seconds)."),
    grace: float = typer.Option(30.0, help="Preemption grace when a node drains (seconds)."),
    apply: float = typer.Option(900.0, help="Seconds to apply the stack (driver and reboot)."),
    burn_in: float = typer.Option(2400.0, help="Seconds of burn-in (dcgmi diag -r 3, NCCL)."),
    fail_rate: float = typer.Option(
        0.0, min=0.0, max=1.0, help="A unit's chance that apply or burn-in fails."
    ),
    repair: float = typer.Option(4 * 3600.0, help="Seconds a failed unit spends in repair."),
    seed: int = typer.Option(1, help="Seeds which units fail (and nothing else)."),
    checkpoint_above: float = typer.Option(
        3600.0, help="Jobs running longer than this (seconds) checkpoint ..."
    ),
    checkpoint_every: float = typer.Option(1800.0, help="... every this many seconds."),
    policy: str = typer.Option("default", help="Queueing policy (BASELINES)."),
    parallel: int = typer.Option(2, help="Replays run at once (processes)."),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per batch size, then a summary."
    ),
) -> None:
    """Replay a rolling software-stack upgrade of the fleet under the Philly load: for each
    batch size, time to finish against utilisation, queueing and lost work, beside the same
    jobs with no upgrade (rackplane_bench/sim/upgrade.py)."""
    import time as _time

    from app.placement.queueing import BASELINES
    from rackplane_bench.sim import philly, upgrade

    batches = [b.strip() for b in batch.split(",") if b.strip()]
    try:
        for b in batches:
            upgrade.parse_count(b, 100)
        upgrade.parse_share(max_unavailable)
        _window(window)
    except ValueError as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    if not batches or policy not in BASELINES or (scale is not None and scale <= 0):
        err.print("[red]--batch needs a size; --policy one of BASELINES; --scale positive[/red]")
        raise typer.Exit(2)
    scale = scale if scale is not None else nodes / 64
    ckpt = upgrade.Checkpoints(above_s=checkpoint_above, every_s=checkpoint_every)
    base = upgrade.Params(
        start_s=start_day * upgrade.DAY,
        max_unavailable=max_unavailable,
        drain_wait_s=drain_wait,
        grace_s=grace,
        apply_s=apply,
        burn_in_s=burn_in,
        fail_rate=fail_rate,
        repair_s=repair,
        seed=seed,
    )
    # Batch sizes that come to the same units at once (1 and 1% of 64 units) replay once.
    fleet = philly.fleet(nodes)
    units = upgrade.units_of(fleet)
    limit = math.floor(upgrade.parse_share(max_unavailable) * nodes * philly.GPUS_PER_NODE + 1e-9)
    biggest = max(sum(fleet[n].gpus for n in u) for u in units)

    def at_once(b: str) -> int:
        return max(1, min(upgrade.parse_count(b, len(units)), limit // biggest))

    first: dict[int, str] = {}
    for b in batches:
        first.setdefault(at_once(b), b)
    runs = [(str(jobs_file), window, scale, nodes, policy, ckpt, None)]
    runs += [
        (str(jobs_file), window, scale, nodes, policy, ckpt, replace(base, batch=b))
        for b in first.values()
    ]
    start = _time.perf_counter()
    if parallel > 1:
        with ProcessPoolExecutor(min(parallel, len(runs))) as pool:
            results = [x["result"] for x in pool.map(_upgrade_one, runs)]
    else:
        results = [_upgrade_one(r)["result"] for r in runs]
    wall = _time.perf_counter() - start
    baseline = results[0]
    by_k = {r.units_at_once: upgrade.summary(r, baseline) for r in results[1:]}
    rows = [by_k[at_once(b)] | {"batch": b} for b in batches]
    for row in rows:
        row.update(nodes=nodes, window=window, scale=round(scale, 4), start_day=start_day)
        if as_json:
            _emit(row, True)
    if not as_json:
        _upgrade_table(rows, nodes, window, scale, start_day, max_unavailable)
    summary = {
        "summary": "sim upgrade",
        "nodes": nodes,
        "gpus": baseline.gpus,
        "jobs": baseline.jobs,
        "window": window,
        "scale": round(scale, 4),
        "start_day": start_day,
        "policy": policy,
        "max_unavailable": max_unavailable,
        "hours_to_finish": {r["batch"]: r["hours_to_finish"] for r in rows},
        "utilisation_drop": {r["batch"]: r["utilisation_drop"] for r in rows},
        "lost_work_gpu_hours": {r["batch"]: r["lost_work_gpu_hours"] for r in rows},
        "params": {
            "drain_wait_s": drain_wait,
            "grace_s": grace,
            "apply_s": apply,
            "burn_in_s": burn_in,
            "fail_rate": fail_rate,
            "repair_s": repair,
            "seed": seed,
            "checkpoint_above_s": checkpoint_above,
            "checkpoint_every_s": checkpoint_every,
        },
        "baseline_seconds": round(baseline.seconds, 1),
        "replay_seconds": {r["batch"]: r["seconds"] for r in rows},
        "wall_seconds": round(wall, 1),
    }
    _emit(summary, as_json)


def _mig_one(args: tuple) -> dict:
    from rackplane_bench.sim import mig

    openb_file, philly_file, params, cfg, policy, fraction = args
    trace = mig.build_trace(Path(openb_file), Path(philly_file), params)
    r = mig.replay(trace, policy, fraction, params, cfg)
    return {"row": r.as_dict(), "swing": trace.mig_share_by_hour, "mix": trace.profile_mix}


@sim_cli.command("mig")
def mig_cmd(
    openb_file: Path = typer.Option(
        TRACES / "openb" / "openb_pod_list_default.csv",
        "--openb",
        exists=True,
        help="openb pods CSV (the inference MIG mix and run times).",
    ),
    philly_file: Path = typer.Option(
        TRACES / "philly" / "philly_jobs.csv",
        "--philly",
        exists=True,
        help="Philly jobs CSV (whole-GPU training: GPU counts and durations).",
    ),
    nodes: int = typer.Option(32, min=1, help="8 x H100-80GB nodes."),
    days: float = typer.Option(3.0, help="Days simulated; the first is warm-up."),
    warmup_days: float = typer.Option(1.0, help="Days before the measured window."),
    load: float = typer.Option(1.0, help="Offered load, in fleet GPU-equivalents on average."),
    inference_share: float = typer.Option(0.5, help="Share of the offered load that is inference."),
    inference_peak_ratio: float = typer.Option(3.0, help="Inference peak/trough [assumption]."),
    training_peak_ratio: float = typer.Option(1.5, help="Training peak/trough, in antiphase."),
    patience_s: float = typer.Option(600.0, help="Inference unserved this long is dropped."),
    mig_rule: str = typer.Option("round7", help="openb gpu_milli -> MIG profile rule."),
    fractions: str = typer.Option(
        "8", help="Static grid: N (fractions 0, 1/N, ..., 1 of the nodes) or a comma list."
    ),
    policies: str = typer.Option(
        ",".join(("dynamic", "static-none", "static-1g", "static-balanced")),
        help="Policies to run.",
    ),
    min_dwell_s: float = typer.Option(
        7200.0, help="Planner: minimum time between changes of a GPU."
    ),
    max_changes_per_gpu_day: int = typer.Option(4, help="Planner: changes of a GPU per 24 h."),
    gain_margin: float = typer.Option(2.0, help="Planner: covered shortfall x dwell / reset cost."),
    max_fraction_per_cycle: float = typer.Option(0.05, help="Planner: GPUs changed per call."),
    reset_cost_s: float = typer.Option(30.0, help="Re-lay with MIG mode kept [assumption]."),
    mode_flip_cost_s: float = typer.Option(120.0, help="MIG mode on/off [assumption]."),
    plan_every_s: float = typer.Option(300.0, help="Planner (and idle queue) tick."),
    seed: int = typer.Option(1, help="Seeds the trace."),
    parallel: int = typer.Option(2, help="Replays run at once (processes)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per policy, then a summary."),
) -> None:
    """MIG layouts by demand: a day-shifting inference (MIG) / training (whole GPU) mix under
    static layouts (the best fraction on a grid) and the dynamic planner
    (rackplane_bench/sim/mig.py, docs/design/mig-layouts.md §5)."""
    from fractions import Fraction

    from app.placement.miglayout import RelayoutConfig
    from rackplane_bench.sim import mig

    chosen = [x.strip() for x in policies.split(",") if x.strip()]
    try:
        mig.profile_of(500, mig_rule)
        if "," in fractions or "/" in fractions or "." in fractions:
            grid = sorted({float(Fraction(x.strip())) for x in fractions.split(",") if x.strip()})
        else:
            steps = int(fractions)
            grid = [i / steps for i in range(steps + 1)]
    except (ValueError, ZeroDivisionError) as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    bad = [x for x in chosen if x not in mig.POLICIES]
    if bad or not chosen or not grid or not 0 <= warmup_days < days:
        err.print(f"[red]--policies among {', '.join(mig.POLICIES)}; a grid; warm-up < days[/red]")
        raise typer.Exit(2)
    params = mig.Params(
        nodes=nodes,
        days=days,
        warmup_days=warmup_days,
        load=load,
        inference_share=inference_share,
        inference_peak_ratio=inference_peak_ratio,
        training_peak_ratio=training_peak_ratio,
        patience_s=patience_s,
        mig_rule=mig_rule,
        plan_every_s=plan_every_s,
        seed=seed,
    )
    cfg = RelayoutConfig(
        reset_cost_s=reset_cost_s,
        mode_flip_cost_s=mode_flip_cost_s,
        min_dwell_s=min_dwell_s,
        gain_margin=gain_margin,
        max_changes_per_gpu_day=max_changes_per_gpu_day,
        max_fraction_per_cycle=max_fraction_per_cycle,
    )
    base = (str(openb_file), str(philly_file), params, cfg)
    # Phase 1, the static grid (f = 0 is static-none for every layout: run once); phase 2,
    # dynamic from static-balanced's best fraction.
    runs = []
    if "static-none" in chosen or any(p.startswith("static-") for p in chosen):
        runs.append((*base, "static-none", 0.0))
    for pol in ("static-1g", "static-balanced"):
        if pol in chosen or (pol == "static-balanced" and "dynamic" in chosen):
            runs += [(*base, pol, f) for f in grid if f > 0]

    def run_all(batch: list) -> list[dict]:
        if parallel > 1 and len(batch) > 1:
            with ProcessPoolExecutor(min(parallel, len(batch))) as pool:
                return list(pool.map(_mig_one, batch))
        return [_mig_one(r) for r in batch]

    import time as _time

    start = _time.perf_counter()
    out = run_all(runs)
    none = [o["row"] for o in out if o["row"]["policy"] == "static-none"]
    rows: dict[str, dict] = {}
    for pol in ("static-none", "static-1g", "static-balanced"):
        cands = none + [o["row"] for o in out if o["row"]["policy"] == pol]
        if not cands:
            continue
        best = max(cands, key=lambda r: (r["demand_served_gpu_hours"], -r["mig_fraction"]))
        rows[pol] = (
            best
            | {
                "policy": pol,
                "grid": {str(r["mig_fraction"]): r["demand_served_gpu_hours"] for r in cands},
            }
            if pol != "static-none"
            else best
        )
    if "dynamic" in chosen:
        f = rows["static-balanced"]["mig_fraction"] if "static-balanced" in rows else 0.375
        rows["dynamic"] = run_all([(*base, "dynamic", f)])[0]["row"]
    swing = out[0]["swing"] if out else _mig_one((*base, "static-none", 0.0))["swing"]
    for pol in chosen:
        _emit(rows[pol], as_json)
    statics = [rows[p] for p in ("static-none", "static-1g", "static-balanced") if p in chosen]
    best_static = max(statics, key=lambda r: r["demand_served_gpu_hours"]) if statics else None
    summary: dict = {
        "summary": "sim mig",
        "nodes": nodes,
        "gpus": nodes * 8,
        "days": days,
        "measured_days": days - warmup_days,
        "seed": seed,
    }
    if best_static is not None:
        summary["best_static"] = best_static["policy"]
        summary["best_static_mig_fraction"] = best_static["mig_fraction"]
        summary["best_static_served_gpu_hours"] = best_static["demand_served_gpu_hours"]
    if best_static is not None and "dynamic" in rows:
        dyn = rows["dynamic"]
        served = best_static["demand_served_gpu_hours"]
        gain = dyn["demand_served_gpu_hours"] / served - 1 if served else 0.0
        summary["gain_vs_best_static"] = round(gain, 4)
        summary["targets"] = {
            "more_than_best_static": dyn["demand_served_gpu_hours"] > served,
            "resets_at_most_3": dyn["resets_per_gpu_day"] <= 3,
        }
    summary["mig_share_of_offered"] = {"min_hourly": min(swing), "max_hourly": max(swing)}
    summary["mig_profile_mix"] = out[0]["mix"] if out else {}
    summary["params"] = {
        "load": load,
        "inference_share": inference_share,
        "inference_peak_ratio": inference_peak_ratio,
        "training_peak_ratio": training_peak_ratio,
        "patience_s": patience_s,
        "mig_rule": mig_rule,
        "min_dwell_s": min_dwell_s,
        "max_changes_per_gpu_day": max_changes_per_gpu_day,
        "gain_margin": gain_margin,
        "max_fraction_per_cycle": max_fraction_per_cycle,
        "reset_cost_s": reset_cost_s,
        "mode_flip_cost_s": mode_flip_cost_s,
        "grid": [round(f, 4) for f in grid],
    }
    summary["seconds"] = round(_time.perf_counter() - start, 1)
    _emit(summary, as_json)


def _window(text: str) -> tuple[float, float]:
    from rackplane_bench.sim import philly

    w = philly.parse_window(text)
    if w is None or not w[0] < w[1]:
        raise ValueError(f"--window {text!r}: START:END in days, START < END")
    return w


def _upgrade_table(
    rows: list[dict], nodes: int, window: str, scale: float, start_day: float, mu: str
) -> None:
    from rich.table import Table

    t = Table(
        title=f"rolling upgrade: {nodes} nodes, Philly {window} (scale {scale:g}), from day "
        f"{start_day:g}, max-unavailable {mu}"
    )
    for col in (
        "batch",
        "units at once",
        "hours to finish",
        "GPU-h out",
        "moved (at ckpt / drained)",
        "lost GPU-h",
        "utilisation (baseline)",
        "drop",
        "mean wait s (baseline)",
        "failures",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["batch"]),
            str(r["units_at_once"]),
            f"{r['hours_to_finish']:,.1f}",
            f"{r['gpu_hours_out_of_service']:,.0f}",
            f"{r['work_moved']} ({r['moved_at_checkpoint']} / {r['drained']})",
            f"{r['lost_work_gpu_hours']:,.1f}",
            f"{r['utilisation']:.4f} ({r['baseline_utilisation']:.4f})",
            f"{r['utilisation_drop']:+.4f}",
            f"{r['mean_queue_wait_s']:,.0f} ({r['baseline_mean_queue_wait_s']:,.0f})",
            str(r["failures"]),
        )
    Console().print(t)
    if not all(r["load_covers_window"] for r in rows):
        err.print("[yellow]the trace's arrivals end before some upgrade does[/yellow]")


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
    a scratch database (see rackplane_bench/lifecycle.py)."""
    from rackplane_bench.deploy import median_of
    from rackplane_bench.lifecycle import run

    for n in [int(x) for x in workers.split(",")]:
        results = [run(n, rate, duration, churn, warmup, concurrency) for _ in range(runs)]
        _emit(median_of(results), as_json)


@bench_cli.command("graphql")
def bench_graphql(
    workloads: int = typer.Option(10_000, help="The tenant's workloads."),
    gpus: int = typer.Option(10_000, help="Fleet size in GPUs (8 per node, two regions)."),
    requests: int = typer.Option(300, help="Timed queries of each kind (after a warm-up)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The portal's dashboard query and the operator's fleet query against a real API
    process on a scratch PostgreSQL database: p50/p99 latency and SQL statements per query
    (see rackplane_bench/graphql.py)."""
    from rackplane_bench.graphql import run

    _emit(run(workloads, gpus, requests), as_json)


@bench_cli.command("portal")
def bench_portal(
    runs: int = typer.Option(7, min=1, help="Page loads timed (after a warm-up)."),
    frames: int = typer.Option(60, min=2, help="Zoom and pan frames timed."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The operators' fleet heatmap of 100,000 GPUs in headless Chromium against a real API on
    a scratch PostgreSQL database: request to full first frame, frame time while zooming and
    panning, and the utilisation chart's query over that fleet (see rackplane_bench/portal.py)."""
    from rackplane_bench.portal import run

    _emit(run(runs, frames), as_json)


@bench_cli.command("api")
def bench_api(
    requests: int = typer.Option(1000, help="Requests per route and run."),
    runs: int = typer.Option(3, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """CPU per request of the API's hot routes (POST, GET, DELETE /v1/workloads), one at a
    time on one API process, with PostgreSQL's and the worker's CPU beside it, on a scratch
    database (see rackplane_bench/lifecycle.py)."""
    from rackplane_bench.deploy import median_of
    from rackplane_bench.lifecycle import run_api

    _emit(median_of([run_api(requests) for _ in range(runs)]), as_json)


@bench_cli.command("metering")
def bench_metering(
    events: int = typer.Option(200_000, help="Ledger events to ingest per run."),
    tenants: int = typer.Option(10_000, help="Tenants in the export month."),
    intervals: int = typer.Option(1_000_000, help="Usage intervals in the export month."),
    runs: int = typer.Option(3, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Ledger ingestion rate and a month's finance export time, on a scratch PostgreSQL
    database (see rackplane_bench/metering.py)."""
    from rackplane_bench.metering import run

    _emit(run(events=events, tenants=tenants, intervals=intervals, runs=runs), as_json)


@bench_cli.command("telemetry")
def bench_telemetry(
    gpus: int = typer.Option(10_000, min=8, help="GPUs reporting (8 per node)."),
    rounds: int = typer.Option(12, min=1, help="Measured rounds (30 s of agent time each)."),
    batch_nodes: int = typer.Option(32, min=1, help="Nodes per push (a rack's relay)."),
    runs: int = typer.Option(1, min=1, help="Repeats; medians are reported."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """DCGM telemetry through the real API into PostgreSQL: samples/s, API CPU and
    database writes per 1000 samples (see rackplane_bench/telemetry.py)."""
    from rackplane_bench.telemetry import median_run

    _emit(median_run(runs, gpus=gpus, rounds=rounds, batch_nodes=batch_nodes), as_json)


@bench_cli.command("recovery")
def bench_recovery(
    gpus: int = typer.Option(10_000, min=512, help="GPUs in the fleet (half get filled)."),
    faults: int = typer.Option(10, min=1, help="Gangs hit by an Xid 79, one at a time."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Xid 79 on one GPU of running 8x8 gangs: fault to requeued and to running again,
    lost work, usage after the fault, double allocations (see rackplane_bench/recovery.py)."""
    from rackplane_bench.recovery import run

    _emit(run(gpus=gpus, faults=faults), as_json)


@bench_cli.command("agents")
def bench_agents(
    agents: int = typer.Option(1000, min=1, help="Simulated node agents (8-GPU H100 nodes)."),
    duration: float = typer.Option(60.0, min=1, help="Seconds measured (after the warm-up)."),
    rate: float | None = typer.Option(
        None, min=0.01, help="Submissions per second (default 4; agents/25 below 100 agents)."
    ),
    warmup: float | None = typer.Option(
        None,
        min=0,
        help="Seconds of the same load first, not measured (default 15, or --duration if "
        "shorter: PostgreSQL's row counts of the joins land before the window).",
    ),
    runs: int = typer.Option(1, min=1, help="Repeats; medians are reported."),
    api_max_in_flight: int | None = typer.Option(
        None,
        help="RACKPLANE_API_MAX_IN_FLIGHT of the API (default: the server's own setting).",
    ),
    py_spy: Path | None = typer.Option(
        None, help="Profile the API over the window with py-spy into this speedscope file."
    ),
    api_app: str = typer.Option(
        "app.main:app", help="The ASGI app the API serves (an A/B of a wrapped app)."
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="The form every change on its path can afford (~2 minutes at 1,000 agents): a "
        "20 s window unless --duration says otherwise; the bring-up burst is included.",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Simulated node agents (one event loop) joining, passing their bring-up burn-in,
    long-polling, heartbeating and reporting runs against one API process and a Celery worker
    while work is submitted: placement commit to the agent's `running` report, the bring-up's
    answers and latencies, API CPU and database rows per agent-minute (see
    rackplane_bench/agents.py)."""
    from rackplane_bench.agents import QUICK_DURATION_S, median_run

    if quick and duration == 60.0:
        duration = QUICK_DURATION_S

    log = (lambda msg: err.print(msg)) if not as_json or sys.stderr.isatty() else (lambda m: None)
    r = median_run(
        runs,
        agents=agents,
        duration=duration,
        rate=rate,
        warmup=warmup,
        api_max_in_flight=api_max_in_flight,
        py_spy=py_spy,
        api_app=api_app,
        log=log,
    )
    if as_json:
        _emit(r, True)
    else:
        _agents_summary(r)


def _agents_summary(r: dict) -> None:
    from rich.table import Table

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    t = Table(title=f"rackplane bench agents: {r['agents']} agents, {r['duration_s']:g} s")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("workloads placed in the window", f"{r['workloads']} ({r['runs']} runs)")
    t.add_row(
        "assign -> start p50 / p99",
        f"{s(r['assign_to_start_p50_s'])} / {s(r['assign_to_start_p99_s'])}",
    )
    t.add_row("  placing -> provisioning p99", s(r["placing_to_provisioning_p99_s"]))
    t.add_row("  provisioning -> agent has it p99", s(r["provisioning_to_received_p99_s"]))
    t.add_row("  report round trip p99", s(r["sent_to_ack_p99_s"]))
    t.add_row("runs never started", str(r["runs_unstarted"]))
    t.add_row("API CPU share of a core", f"{r['api_cpu_share']:.3f}")
    t.add_row("API CPU s per agent-minute", f"{r['api_cpu_s_per_agent_minute']:.5f}")
    t.add_row("DB rows per agent-minute", f"{r['db_rows_per_agent_minute']:.2f}")
    t.add_row(
        "long polls (woken) / status reports",
        f"{r['long_polls']} ({r['long_polls_woken']}) / {r['status_reports']}",
    )
    t.add_row(
        "5xx answers (window / whole run)", f"{r['errors_5xx']} / {r['errors_5xx_whole_run']}"
    )
    t.add_row("requests without an answer", str(r["errors_no_answer"]))
    t.add_row("whole run", f"{r['seconds']:g} s")
    Console().print(t)


@bench_cli.command("failover")
def bench_failover(
    faults: str = typer.Option(
        ",".join(FAILOVER_FAULTS),
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
    from rackplane_bench.failover import run
    from rackplane_bench.ha import missing_engines

    if missing_engines():
        err.print(f"[red]missing {', '.join(missing_engines())}: run scripts/ensure-ha.sh[/red]")
        raise typer.Exit(2)
    chosen = tuple(f.strip() for f in faults.split(",") if f.strip())
    unknown = sorted(set(chosen) - set(FAILOVER_FAULTS))
    if unknown:
        raise typer.BadParameter(f"unknown faults: {', '.join(unknown)}", param_hint="--faults")
    _emit(run(chosen, rate=rate, gap=gap), as_json)


@bench_cli.command("ddp")
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
    from rackplane_bench.ddp import Unavailable, bench

    try:
        result = bench(hosts=hosts, runs=runs, log=lambda line: err.print(line))
    except Unavailable as exc:
        err.print(f"ddp cannot run here: {exc}")
        raise typer.Exit(2) from None
    _emit(result, as_json)


@bench_cli.command("instances")
def bench_instances(
    launches: int = typer.Option(10, min=1, help="Instances of each runtime, one at a time."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Time from POST /v1/workloads to the first SSH login with the tenant's key, for
    container (podman) and VM instances on a real agent of this machine (root, podman, QEMU),
    p50 and p95; then the escapes of issue 44 §4 tried from inside them (`escapes`: those that
    worked). See rackplane_bench/instances.py."""
    from rackplane_bench.instances import Unavailable, bench

    try:
        result = bench(launches=launches, log=lambda line: err.print(line))
    except Unavailable as exc:
        err.print(f"instances cannot run here: {exc}")
        raise typer.Exit(2) from None
    _emit(result, as_json)


@bench_cli.command("serve")
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
    from rackplane_bench.serve import Day, Model, Setup, bench

    model = None
    if token_ms is not None or batch_cost is not None:
        model = Model(token_ms=token_ms or 20.0, batch_cost=batch_cost or 0.05)
    setup = Setup(slo_ms=slo_ms, max_replicas=max_replicas, cold_start_s=cold_start_s)
    day = Day(day_s=day_s, peak_rps=peak_rps, burst_x=burst_x)
    for doc in bench(day, setup, model, seed, log=lambda line: err.print(line)):
        _emit(doc, as_json)
