"""`rackplane sim upgrade`: a rolling software-stack upgrade of the fleet under the Philly load,
one replay per batch size beside the same jobs with no upgrade."""

from __future__ import annotations

import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from app.placement.queueing import BASELINES
from rackplane_bench.commands.common import TRACES, emit, err
from rackplane_bench.sim import philly, upgrade

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class UpgradeOptions:
    """`rackplane sim upgrade`'s options (their help is on upgrade_cmd)."""

    jobs_file: Path
    nodes: int
    window: str
    scale: float | None
    start_day: float
    batch: str
    max_unavailable: str
    drain_wait: float
    grace: float
    apply: float
    burn_in: float
    fail_rate: float
    repair: float
    seed: int
    checkpoint_above: float
    checkpoint_every: float
    policy: str
    parallel: int
    as_json: bool


@cli.command("upgrade")
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
    execute(
        UpgradeOptions(
            jobs_file=jobs_file,
            nodes=nodes,
            window=window,
            scale=scale,
            start_day=start_day,
            batch=batch,
            max_unavailable=max_unavailable,
            drain_wait=drain_wait,
            grace=grace,
            apply=apply,
            burn_in=burn_in,
            fail_rate=fail_rate,
            repair=repair,
            seed=seed,
            checkpoint_above=checkpoint_above,
            checkpoint_every=checkpoint_every,
            policy=policy,
            parallel=parallel,
            as_json=as_json,
        )
    )


def execute(opts: UpgradeOptions) -> None:
    """The baseline and each distinct batch size replayed; a row per batch size (a table, or
    JSON objects), then a summary."""
    batches = _checked(opts)
    scale = opts.scale if opts.scale is not None else opts.nodes / 64
    ckpt = upgrade.Checkpoints(above_s=opts.checkpoint_above, every_s=opts.checkpoint_every)
    base = _params(opts)
    # Batch sizes that come to the same units at once (1 and 1% of 64 units) replay once.
    at_once = _units_at_once(opts.nodes, opts.max_unavailable, batches)
    first: dict[int, str] = {}
    for b in batches:
        first.setdefault(at_once[b], b)
    job = (str(opts.jobs_file), opts.window, scale, opts.nodes, opts.policy, ckpt)
    runs = [(*job, None)] + [(*job, replace(base, batch=b)) for b in first.values()]
    start = time.perf_counter()
    if opts.parallel > 1:
        with ProcessPoolExecutor(min(opts.parallel, len(runs))) as pool:
            results = [x["result"] for x in pool.map(_one, runs)]
    else:
        results = [_one(r)["result"] for r in runs]
    wall = time.perf_counter() - start
    baseline = results[0]
    by_k = {r.units_at_once: upgrade.summary(r, baseline) for r in results[1:]}
    rows = [by_k[at_once[b]] | {"batch": b} for b in batches]
    for row in rows:
        row.update(
            nodes=opts.nodes, window=opts.window, scale=round(scale, 4), start_day=opts.start_day
        )
        if opts.as_json:
            emit(row, True)
    if not opts.as_json:
        _table(rows, opts.nodes, opts.window, scale, opts.start_day, opts.max_unavailable)
    emit(_summary(opts, scale, baseline, rows, wall), opts.as_json)


def _checked(opts: UpgradeOptions) -> list[str]:
    """The batch sizes asked for; exit 2 on a bad batch, share, window, policy or scale."""
    batches = [b.strip() for b in opts.batch.split(",") if b.strip()]
    try:
        for b in batches:
            upgrade.parse_count(b, 100)
        upgrade.parse_share(opts.max_unavailable)
        _window(opts.window)
    except ValueError as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    if not batches or opts.policy not in BASELINES or (opts.scale is not None and opts.scale <= 0):
        err.print("[red]--batch needs a size; --policy one of BASELINES; --scale positive[/red]")
        raise typer.Exit(2)
    return batches


def _window(text: str) -> tuple[float, float]:
    w = philly.parse_window(text)
    if w is None or not w[0] < w[1]:
        raise ValueError(f"--window {text!r}: START:END in days, START < END")
    return w


def _params(opts: UpgradeOptions) -> upgrade.Params:
    """The upgrade's parameters but the batch size."""
    return upgrade.Params(
        start_s=opts.start_day * upgrade.DAY,
        max_unavailable=opts.max_unavailable,
        drain_wait_s=opts.drain_wait,
        grace_s=opts.grace,
        apply_s=opts.apply,
        burn_in_s=opts.burn_in,
        fail_rate=opts.fail_rate,
        repair_s=opts.repair,
        seed=opts.seed,
    )


def _units_at_once(nodes: int, max_unavailable: str, batches: list[str]) -> dict[str, int]:
    """Units each batch size upgrades at once in this fleet: at least one, at most what
    --max-unavailable leaves room for."""
    fleet = philly.fleet(nodes)
    units = upgrade.units_of(fleet)
    limit = math.floor(upgrade.parse_share(max_unavailable) * nodes * philly.GPUS_PER_NODE + 1e-9)
    biggest = max(sum(fleet[n].gpus for n in u) for u in units)
    return {b: max(1, min(upgrade.parse_count(b, len(units)), limit // biggest)) for b in batches}


def _one(args: tuple) -> dict:
    """One replay (in a worker process when run in parallel); params None: no upgrade."""
    jobs_file, window, scale, nodes, policy, ckpt, params = args
    jobs = philly.load_jobs(Path(jobs_file), philly.parse_window(window), scale)
    jobs = upgrade.with_checkpoints(jobs, ckpt)
    tenants = philly.quotas(jobs, nodes * philly.GPUS_PER_NODE)
    r = upgrade.replay(jobs, nodes, tenants, params, policy)
    # What the summary needs, not the whole timeline (it crosses a process boundary).
    r.moves, r.unit_log = [], []
    return {"result": r}


def _summary(
    opts: UpgradeOptions, scale: float, baseline: upgrade.Result, rows: list[dict], wall: float
) -> dict:
    return {
        "summary": "sim upgrade",
        "nodes": opts.nodes,
        "gpus": baseline.gpus,
        "jobs": baseline.jobs,
        "window": opts.window,
        "scale": round(scale, 4),
        "start_day": opts.start_day,
        "policy": opts.policy,
        "max_unavailable": opts.max_unavailable,
        "hours_to_finish": {r["batch"]: r["hours_to_finish"] for r in rows},
        "utilisation_drop": {r["batch"]: r["utilisation_drop"] for r in rows},
        "lost_work_gpu_hours": {r["batch"]: r["lost_work_gpu_hours"] for r in rows},
        "params": {
            "drain_wait_s": opts.drain_wait,
            "grace_s": opts.grace,
            "apply_s": opts.apply,
            "burn_in_s": opts.burn_in,
            "fail_rate": opts.fail_rate,
            "repair_s": opts.repair,
            "seed": opts.seed,
            "checkpoint_above_s": opts.checkpoint_above,
            "checkpoint_every_s": opts.checkpoint_every,
        },
        "baseline_seconds": round(baseline.seconds, 1),
        "replay_seconds": {r["batch"]: r["seconds"] for r in rows},
        "wall_seconds": round(wall, 1),
    }


def _table(
    rows: list[dict], nodes: int, window: str, scale: float, start_day: float, mu: str
) -> None:
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
