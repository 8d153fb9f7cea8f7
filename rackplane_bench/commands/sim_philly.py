"""`rackplane sim philly`: Philly jobs through the queueing core under several policies, the same
jobs for each, then each policy against fifo."""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from app.placement.queueing import BASELINES, QueueConfig
from rackplane_bench.commands.common import TRACES, emit, err
from rackplane_bench.sim import philly

cli = typer.Typer(add_completion=False)

# The reference baselines: the others are compared with fifo, and --share-cap leaves these as
# they are.
REFERENCES = ("fifo", "priority")


@dataclass(frozen=True)
class PhillyOptions:
    """`rackplane sim philly`'s options (their help is on philly_cmd)."""

    jobs_file: Path
    policy: str
    nodes: int
    window: str | None
    scale: float
    stacks: int
    parallel: int
    share_cap: str | None
    as_json: bool


@cli.command("philly")
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
    execute(
        PhillyOptions(
            jobs_file=jobs_file,
            policy=policy,
            nodes=nodes,
            window=window,
            scale=scale,
            stacks=stacks,
            parallel=parallel,
            share_cap=share_cap,
            as_json=as_json,
        )
    )


def execute(opts: PhillyOptions) -> None:
    """One result per policy, then a summary of each policy but the references against fifo."""
    names = [p.strip() for p in opts.policy.split(",") if p.strip()]
    unknown = [p for p in names if p not in BASELINES]
    if unknown or not names:
        err.print(f"[red]unknown policy {unknown}[/red]; known: {', '.join(BASELINES)}")
        raise typer.Exit(2)
    if opts.scale <= 0:
        err.print("[red]--scale must be positive[/red]")
        raise typer.Exit(2)
    configs = {p: BASELINES[p] for p in names}
    if opts.share_cap is not None:
        cap = _parse_share_cap(opts.share_cap)
        if all(p in REFERENCES for p in names):
            err.print("[yellow]--share-cap leaves fifo and priority as they are[/yellow]")
        for p in names:
            if p not in REFERENCES:
                configs[p] = replace(configs[p], share_cap=cap)
    runs = [
        (str(opts.jobs_file), opts.window, opts.scale, opts.nodes, p, configs[p], opts.stacks)
        for p in names
    ]
    if opts.parallel > 1 and len(runs) > 1:
        with ProcessPoolExecutor(min(opts.parallel, len(runs))) as pool:
            results = list(pool.map(_one, runs))
    else:
        results = [_one(r) for r in runs]
    by = {r["policy"]: r for r in results}
    for r in results:
        emit(r, opts.as_json)
    f = by.get("fifo")
    for name in names:
        if f is None or name in REFERENCES:
            continue
        emit(_against_fifo(name, by[name], f), opts.as_json)


def _parse_share_cap(text: str) -> float | None:
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


def _one(args: tuple[str, str | None, float, int, str, QueueConfig, int]) -> dict:
    """One policy's replay (in a worker process when run in parallel)."""
    jobs_file, window, scale, nodes, policy, config, stacks = args
    jobs = philly.load_jobs(Path(jobs_file), philly.parse_window(window), scale)
    tenants = philly.quotas(jobs, nodes * philly.GPUS_PER_NODE)
    out = philly.replay(jobs, nodes, policy, tenants, config, stacks).as_dict()
    out.update(window=window or "all", scale=scale, nodes=nodes, stacks=stacks)
    return out


def _against_fifo(name: str, d: dict, f: dict) -> dict:
    """Policy `name`'s result `d` against fifo's `f`, with the targets it meets."""
    return {
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
