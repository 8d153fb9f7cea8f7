"""`rackplane sim faults`: a large training job and background work under hardware faults drawn
at published rates, replayed under each recovery policy on the same faults, for one fleet size
or several (with a plot of effective training time by fleet size)."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import typer
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from rackplane_bench.commands.common import TRACES, emit, err
from rackplane_bench.sim import faults

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class FaultsOptions:
    """`rackplane sim faults`'s options (their help is on faults_cmd)."""

    gpus: str
    days: float
    policy: str
    seed: int
    faults_per_gpu_day: float
    checkpoint_every: float
    checkpoint_cost: float
    restart: float
    provision: float
    detect: float
    hang_timeout: float
    stall_detect: float
    human: float
    hot_spares: int | None
    spare_share: float
    warned: float
    background_load: float
    jobs_file: Path
    parallel: int
    plot: Path | None
    as_json: bool


@cli.command("faults")
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
    execute(
        FaultsOptions(
            gpus=gpus,
            days=days,
            policy=policy,
            seed=seed,
            faults_per_gpu_day=faults_per_gpu_day,
            checkpoint_every=checkpoint_every,
            checkpoint_cost=checkpoint_cost,
            restart=restart,
            provision=provision,
            detect=detect,
            hang_timeout=hang_timeout,
            stall_detect=stall_detect,
            human=human,
            hot_spares=hot_spares,
            spare_share=spare_share,
            warned=warned,
            background_load=background_load,
            jobs_file=jobs_file,
            parallel=parallel,
            plot=plot,
            as_json=as_json,
        )
    )


def execute(opts: FaultsOptions) -> None:
    """Each replay (a table, or a JSON object), then a summary per fleet size, then the plot."""
    names, sizes = _checked(opts)
    base = _params(opts)
    trace = str(opts.jobs_file) if opts.background_load > 0 else None
    runs = [(replace(base, gpus=g), p, trace) for g in sizes for p in names]
    start = time.perf_counter()
    if opts.parallel > 1 and len(runs) > 1:
        with ProcessPoolExecutor(min(opts.parallel, len(runs))) as pool:
            results = list(pool.map(_one, runs))
    else:
        results = [_one(r) for r in runs]
    wall = time.perf_counter() - start
    for r in results:
        if not opts.as_json:
            _table(r)
        else:
            emit(r, opts.as_json)
    by = {(r["gpus"], r["policy"]): r for r in results}
    for g in sizes:
        emit(_summary(g, opts.days, names, by), opts.as_json)
    if not opts.as_json:
        err.print(f"{len(runs)} replays in {wall:.0f} s")
    if opts.plot is not None:
        _plot(results, names, opts.plot)


def _checked(opts: FaultsOptions) -> tuple[list[str], list[int]]:
    """The policies and fleet sizes asked for; exit 2 on a bad one or a missing trace."""
    names = [p.strip() for p in opts.policy.split(",") if p.strip()]
    bad = [p for p in names if p not in faults.POLICIES]
    if bad or not names:
        err.print(f"[red]unknown policy {bad}[/red]; known: {', '.join(faults.POLICIES)}")
        raise typer.Exit(2)
    try:
        sizes = [int(x) for x in opts.gpus.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(g < 64 for g in sizes) or opts.days <= 0:
        err.print("[red]--gpus takes fleet sizes of at least 64 GPUs; --days is positive[/red]")
        raise typer.Exit(2)
    if opts.background_load > 0 and not opts.jobs_file.exists():
        err.print(f"[red]no background trace at {opts.jobs_file}[/red] (or --background-load 0)")
        raise typer.Exit(2)
    return names, sizes


def _params(opts: FaultsOptions) -> faults.Params:
    """The replay's parameters but the fleet size; --warned applies to the hardware causes a
    rule can see coming."""
    causes = tuple(
        c if c.detect == "crash" or c.rule is None else replace(c, warned=opts.warned)
        for c in faults.LLAMA3
    )
    return faults.Params(
        days=opts.days,
        seed=opts.seed,
        faults_per_gpu_day=opts.faults_per_gpu_day,
        spare_share=opts.spare_share,
        hot_spares=opts.hot_spares,
        checkpoint_every_s=opts.checkpoint_every,
        checkpoint_cost_s=opts.checkpoint_cost,
        restart_s=opts.restart,
        provision_s=opts.provision,
        detect_s=opts.detect,
        hang_timeout_s=opts.hang_timeout,
        stall_detect_s=opts.stall_detect,
        human_s=opts.human,
        background_load=opts.background_load,
        causes=causes,
    )


def _one(args: tuple) -> dict:
    """One replay (in a worker process when run in parallel)."""
    params, policy, jobs_file = args
    fs = faults.draw_faults(params)
    bg = faults.background_jobs(params, Path(jobs_file)) if jobs_file else []
    return faults.replay(params, policy, fs, bg).as_dict()


def _summary(g: int, days: float, names: list[str], by: dict[tuple[int, str], dict]) -> dict:
    """Fleet size `g`'s figures under each policy (and the targets, at Llama 3's scale)."""
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
    return summary


def _table(r: dict) -> None:
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


def _plot(results: list[dict], names: list[str], path: Path) -> None:
    """Effective training time by fleet size, a line per policy (a PNG, drawn off screen)."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
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
