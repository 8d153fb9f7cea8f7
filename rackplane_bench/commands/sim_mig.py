"""`rackplane sim mig`: MIG layouts by demand. A day-shifting inference (MIG) / training (whole
GPU) mix under static layouts, each at the best fraction of a grid, and under the dynamic
planner (docs/design/mig-layouts.md §5)."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import typer

from app.placement.miglayout import RelayoutConfig
from rackplane_bench.commands.common import TRACES, emit, err
from rackplane_bench.sim import mig

cli = typer.Typer(add_completion=False)

STATICS = ("static-none", "static-1g", "static-balanced")


@dataclass(frozen=True)
class MigOptions:
    """`rackplane sim mig`'s options (their help is on mig_cmd)."""

    openb_file: Path
    philly_file: Path
    nodes: int
    days: float
    warmup_days: float
    load: float
    inference_share: float
    inference_peak_ratio: float
    training_peak_ratio: float
    patience_s: float
    mig_rule: str
    fractions: str
    policies: str
    min_dwell_s: float
    max_changes_per_gpu_day: int
    gain_margin: float
    max_fraction_per_cycle: float
    reset_cost_s: float
    mode_flip_cost_s: float
    plan_every_s: float
    seed: int
    parallel: int
    as_json: bool


@cli.command("mig")
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
    execute(
        MigOptions(
            openb_file=openb_file,
            philly_file=philly_file,
            nodes=nodes,
            days=days,
            warmup_days=warmup_days,
            load=load,
            inference_share=inference_share,
            inference_peak_ratio=inference_peak_ratio,
            training_peak_ratio=training_peak_ratio,
            patience_s=patience_s,
            mig_rule=mig_rule,
            fractions=fractions,
            policies=policies,
            min_dwell_s=min_dwell_s,
            max_changes_per_gpu_day=max_changes_per_gpu_day,
            gain_margin=gain_margin,
            max_fraction_per_cycle=max_fraction_per_cycle,
            reset_cost_s=reset_cost_s,
            mode_flip_cost_s=mode_flip_cost_s,
            plan_every_s=plan_every_s,
            seed=seed,
            parallel=parallel,
            as_json=as_json,
        )
    )


def execute(opts: MigOptions) -> None:
    """Phase 1, the static grid (f = 0 is static-none for every layout: run once); phase 2,
    dynamic from static-balanced's best fraction. A row per policy, then a summary."""
    chosen, grid = _checked(opts)
    base = (str(opts.openb_file), str(opts.philly_file), _params(opts), _relayout_config(opts))
    runs = []
    if "static-none" in chosen or any(p.startswith("static-") for p in chosen):
        runs.append((*base, "static-none", 0.0))
    for pol in ("static-1g", "static-balanced"):
        if pol in chosen or (pol == "static-balanced" and "dynamic" in chosen):
            runs += [(*base, pol, f) for f in grid if f > 0]
    start = time.perf_counter()
    out = _replay_all(runs, opts.parallel)
    rows = _best_statics(out)
    if "dynamic" in chosen:
        f = rows["static-balanced"]["mig_fraction"] if "static-balanced" in rows else 0.375
        rows["dynamic"] = _replay_all([(*base, "dynamic", f)], opts.parallel)[0]["row"]
    swing = out[0]["swing"] if out else _one((*base, "static-none", 0.0))["swing"]
    for pol in chosen:
        emit(rows[pol], opts.as_json)
    summary = _summary(opts, chosen, rows)
    summary["mig_share_of_offered"] = {"min_hourly": min(swing), "max_hourly": max(swing)}
    summary["mig_profile_mix"] = out[0]["mix"] if out else {}
    summary["params"] = _params_echo(opts, grid)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    emit(summary, opts.as_json)


def _checked(opts: MigOptions) -> tuple[list[str], list[float]]:
    """The policies asked for and the static grid's fractions; exit 2 on a bad one."""
    chosen = [x.strip() for x in opts.policies.split(",") if x.strip()]
    try:
        mig.profile_of(500, opts.mig_rule)
        if "," in opts.fractions or "/" in opts.fractions or "." in opts.fractions:
            grid = sorted(
                {float(Fraction(x.strip())) for x in opts.fractions.split(",") if x.strip()}
            )
        else:
            steps = int(opts.fractions)
            grid = [i / steps for i in range(steps + 1)]
    except (ValueError, ZeroDivisionError) as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    bad = [x for x in chosen if x not in mig.POLICIES]
    if bad or not chosen or not grid or not 0 <= opts.warmup_days < opts.days:
        err.print(f"[red]--policies among {', '.join(mig.POLICIES)}; a grid; warm-up < days[/red]")
        raise typer.Exit(2)
    return chosen, grid


def _params(opts: MigOptions) -> mig.Params:
    return mig.Params(
        nodes=opts.nodes,
        days=opts.days,
        warmup_days=opts.warmup_days,
        load=opts.load,
        inference_share=opts.inference_share,
        inference_peak_ratio=opts.inference_peak_ratio,
        training_peak_ratio=opts.training_peak_ratio,
        patience_s=opts.patience_s,
        mig_rule=opts.mig_rule,
        plan_every_s=opts.plan_every_s,
        seed=opts.seed,
    )


def _relayout_config(opts: MigOptions) -> RelayoutConfig:
    """The dynamic planner's settings."""
    return RelayoutConfig(
        reset_cost_s=opts.reset_cost_s,
        mode_flip_cost_s=opts.mode_flip_cost_s,
        min_dwell_s=opts.min_dwell_s,
        gain_margin=opts.gain_margin,
        max_changes_per_gpu_day=opts.max_changes_per_gpu_day,
        max_fraction_per_cycle=opts.max_fraction_per_cycle,
    )


def _one(args: tuple) -> dict:
    """One replay (in a worker process when run in parallel): its row, and the trace's hourly
    MIG share and profile mix."""
    openb_file, philly_file, params, cfg, policy, fraction = args
    trace = mig.build_trace(Path(openb_file), Path(philly_file), params)
    r = mig.replay(trace, policy, fraction, params, cfg)
    return {"row": r.as_dict(), "swing": trace.mig_share_by_hour, "mix": trace.profile_mix}


def _replay_all(batch: list, parallel: int) -> list[dict]:
    if parallel > 1 and len(batch) > 1:
        with ProcessPoolExecutor(min(parallel, len(batch))) as pool:
            return list(pool.map(_one, batch))
    return [_one(r) for r in batch]


def _best_statics(out: list[dict]) -> dict[str, dict]:
    """Each static layout's best row on the grid (most demand served, then the smallest MIG
    fraction), with the grid's figures beside it; f = 0 counts for each."""
    none = [o["row"] for o in out if o["row"]["policy"] == "static-none"]
    rows: dict[str, dict] = {}
    for pol in STATICS:
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
    return rows


def _summary(opts: MigOptions, chosen: list[str], rows: dict[str, dict]) -> dict:
    """The fleet, the best static layout, and dynamic's gain over it with the targets."""
    statics = [rows[p] for p in STATICS if p in chosen]
    best_static = max(statics, key=lambda r: r["demand_served_gpu_hours"]) if statics else None
    summary: dict = {
        "summary": "sim mig",
        "nodes": opts.nodes,
        "gpus": opts.nodes * 8,
        "days": opts.days,
        "measured_days": opts.days - opts.warmup_days,
        "seed": opts.seed,
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
    return summary


def _params_echo(opts: MigOptions, grid: list[float]) -> dict:
    """The summary's record of the trace's and the planner's settings."""
    return {
        "load": opts.load,
        "inference_share": opts.inference_share,
        "inference_peak_ratio": opts.inference_peak_ratio,
        "training_peak_ratio": opts.training_peak_ratio,
        "patience_s": opts.patience_s,
        "mig_rule": opts.mig_rule,
        "min_dwell_s": opts.min_dwell_s,
        "max_changes_per_gpu_day": opts.max_changes_per_gpu_day,
        "gain_margin": opts.gain_margin,
        "max_fraction_per_cycle": opts.max_fraction_per_cycle,
        "reset_cost_s": opts.reset_cost_s,
        "mode_flip_cost_s": opts.mode_flip_cost_s,
        "grid": [round(f, 4) for f in grid],
    }
