"""`rackplane sim openb`: the openb replay under the published FGD protocol, one run per seed
(in parallel processes if asked), then the mean."""

from __future__ import annotations

import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from app.placement.policies import DEFAULT_POLICY, POLICIES
from rackplane_bench.commands.common import TRACES, emit, err, parse_seeds
from rackplane_bench.sim import openb

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class OpenbOptions:
    """`rackplane sim openb`'s options (their help is on openb_cmd)."""

    nodes: Path
    pods: Path
    policy: str
    seed: int
    seeds: str | None
    jobs: int
    bound: bool
    stacks: int
    as_json: bool


@cli.command("openb")
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
    execute(
        OpenbOptions(
            nodes=nodes,
            pods=pods,
            policy=policy,
            seed=seed,
            seeds=seeds,
            jobs=jobs,
            bound=bound,
            stacks=stacks,
            as_json=as_json,
        )
    )


def execute(opts: OpenbOptions) -> None:
    """Each seed's replay as it finishes (a progress bar on a terminal), then their mean."""
    if opts.policy not in POLICIES:
        err.print(f"[red]unknown policy {opts.policy!r}[/red]; known: {', '.join(POLICIES)}")
        raise typer.Exit(2)
    runs = [
        (str(opts.nodes), str(opts.pods), opts.policy, s, opts.bound, opts.stacks)
        for s in parse_seeds(opts.seed, opts.seeds)
    ]
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
        task = progress.add_task(f"openb {opts.pods.name} {opts.policy}", total=len(runs))
        if opts.jobs > 1 and len(runs) > 1:
            with ProcessPoolExecutor(opts.jobs) as pool:
                for r in pool.map(_one, runs):
                    results.append(r)
                    emit(r, opts.as_json)
                    progress.advance(task)
        else:
            for run in runs:
                r = _one(run)
                results.append(r)
                emit(r, opts.as_json)
                progress.advance(task)
    if len(results) > 1:
        emit(_mean(opts, results), opts.as_json)


def _one(args: tuple[str, str, str, int, bool, int]) -> dict:
    """One seed's replay (in a worker process when run in parallel)."""
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


def _mean(opts: OpenbOptions, results: list[dict]) -> dict:
    keys = ["alloc_pct_at_130", "frag_ratio_at_90", "placed", "dropped", "seconds"]
    if opts.bound:
        keys += ["bound_pct_at_130", "offline_bound_pct_at_130"]
    return {
        "policy": opts.policy,
        "pods_file": opts.pods.name,
        "seeds": [r["seed"] for r in results],
        **{f"mean_{k}": round(statistics.fmean(r[k] for r in results), 4) for k in keys},
        "stdev_alloc_pct_at_130": round(
            statistics.pstdev(r["alloc_pct_at_130"] for r in results), 4
        ),
    }
