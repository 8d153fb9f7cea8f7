"""`rackplane chaos ...`: chaos experiments, faults through the telemetry path within a blast
radius."""

from __future__ import annotations

import json

import typer
from pydantic import ValidationError
from rich.table import Table

from app.chaos import service as chaos_service
from app.chaos.inject import stop
from app.chaos.report import experiment_view
from app.chaos.schemas import ExperimentIn, ExperimentOut, ExperimentState, ExperimentSummaryOut
from app.chaos.targets import ChaosDisabled
from app.cli.common import console, fail
from app.core.db import get_or_404, session_scope
from app.core.errors import AppError
from app.core.schemas import PageParams
from app.models.chaos import ChaosExperiment

chaos_cli = typer.Typer(
    help="Chaos experiments: faults through the telemetry path, within a blast radius.",
    no_args_is_help=True,
)


def _chaos_print(exp_out: dict, as_json: bool) -> None:
    out = ExperimentOut.model_validate(exp_out)
    if as_json:
        console.print_json(out.model_dump_json())
        return
    console.print(
        f"experiment {out.id} ({out.name}): {out.state}, round {out.rounds}"
        + (f" (next at {out.next_at:%Y-%m-%d %H:%M:%S})" if out.next_at else "")
        + f", {out.gpus_touched} GPU(s) in its "
        f"blast radius; invariants {'held' if out.held else 'BROKEN'}: "
        + ", ".join(f"{k} {v}" for k, v in out.invariants.model_dump().items())
    )
    table = Table(
        "node",
        "GPU",
        "incident class",
        "detect s",
        "quarantine s",
        "requeue s",
        "running s",
        "workloads",
        "lost GPU-s",
    )

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for f in out.report:
        table.add_row(
            f.node,
            str(f.gpu_index),
            f.action or "-",
            s(f.detect_s),
            s(f.quarantine_s),
            s(f.requeue_s),
            s(f.running_s),
            str(len(f.workloads)),
            f"{f.lost_work_gpu_s:.1f}",
        )
    console.print(table)


@chaos_cli.command("inject")
def chaos_inject(
    max_gpus: int = typer.Option(..., min=1, help="Blast radius: the most GPUs taken out."),
    max_share: float = typer.Option(..., min=0.0001, max=1.0, help="Blast radius: region share."),
    xid: int | None = typer.Option(None, help="Inject this Xid."),
    ecc: bool = typer.Option(False, help="Inject uncorrectable ECC errors instead."),
    throttle: float | None = typer.Option(
        None, min=0.1, max=0.99, help="Thermal throttling instead: the clock share left."
    ),
    node_loss: bool = typer.Option(False, help="Lose the node instead: its heartbeat stops."),
    nvlink: bool = typer.Option(False, help="NVLink errors on the target's NVLink domain."),
    provider_fails: str | None = typer.Option(
        None, help="The provider fails to 'boot' or to 'repair' on the target's nodes instead."
    ),
    rack: str | None = typer.Option(None, help="Target: every node (GPU) of this rack."),
    noisy_neighbour: float | None = typer.Option(
        None,
        help="A noisy neighbour on the shared --node --gpu instead: its other workloads' step "
        "time over their best (e.g. 2).",
    ),
    node: str | None = typer.Option(
        None, help="Target: this node's --gpu (the node itself for --node-loss, --nvlink)."
    ),
    gpu: int | None = typer.Option(None),
    random_gpus: int | None = typer.Option(None, help="Target: N random GPUs holding work."),
    tier: str | None = typer.Option(None, help="With --random-gpus: only work of this tier."),
    name: str = typer.Option("chaos from the CLI"),
    at: str | None = typer.Option(None, help="First round at this time (ISO 8601, with offset)."),
    every: int | None = typer.Option(None, help="Seconds between rounds (with --times)."),
    times: int = typer.Option(1, help="Rounds in all."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Start an experiment now or on a schedule (needs RACKPLANE_CHAOS_ENABLED=true in this
    process's environment or ./.env, as the server does)."""
    target = _inject_target(node, gpu, rack, random_gpus, tier)
    fault = _inject_fault(
        target, xid, ecc, throttle, node_loss, nvlink, provider_fails, noisy_neighbour
    )
    out = _start_experiment(
        {
            "name": name,
            "faults": [fault],
            "blast_radius": {"max_gpus": max_gpus, "max_region_share": max_share},
            "schedule": None
            if at is None and times == 1
            else {
                "at": at,
                "times": times,
                **({"every_s": every} if every is not None else {}),
            },
        }
    )
    _chaos_print(out, as_json)


def _inject_target(
    node: str | None, gpu: int | None, rack: str | None, random_gpus: int | None, tier: str | None
) -> dict:
    """The fault's target from `chaos inject`'s options: a rack, a node (its GPU), or random."""
    target: dict = (
        {"node": node, "gpu": gpu} if node else {"random_gpus": random_gpus, "holding_tier": tier}
    )
    if node and gpu is None:
        target = {"node": node}
    if rack:
        target = {"rack": rack}
    return target


def _inject_fault(
    target: dict,
    xid: int | None,
    ecc: bool,
    throttle: float | None,
    node_loss: bool,
    nvlink: bool,
    provider_fails: str | None,
    noisy_neighbour: float | None,
) -> dict:
    """The fault from `chaos inject`'s options: an Xid unless another kind is asked for."""
    fault: dict = {"kind": "xid", "code": xid, "target": target}
    if noisy_neighbour is not None:
        fault = {"kind": "noisy_neighbour", "slowdown": noisy_neighbour, "target": target}
    elif provider_fails:
        fault = {"kind": "provider", "fails": provider_fails, "target": target}
    elif node_loss:
        fault = {"kind": "node_loss", "target": target}
    elif nvlink:
        fault = {"kind": "nvlink", "target": target}
    elif ecc:
        fault = {"kind": "ecc_dbe", "target": target}
    elif throttle is not None:
        fault = {"kind": "throttle", "speed": throttle, "target": target}
    return fault


def _start_experiment(document: dict) -> dict:
    """Validate the experiment and start it, as the API does; exit 2 saying why it cannot."""
    try:
        body = ExperimentIn.model_validate(document)
        with session_scope() as session:
            out = experiment_view(session, chaos_service.start(session, body))
    except ValidationError as exc:
        fail("; ".join(e["msg"] for e in exc.errors()), 2)
    except ChaosDisabled:
        # The CLI is a process of its own that writes to the database itself: it reads the
        # switch as the server does (its environment, then ./.env), not from the server. Set
        # where both read it, they agree.
        fail(
            "chaos experiments are off for this command: the CLI reads RACKPLANE_CHAOS_ENABLED "
            "from its own environment or ./.env, as the server does; set "
            "RACKPLANE_CHAOS_ENABLED=true in .env (read by both) or export it in this shell too",
            2,
        )
    except AppError as exc:
        fail(exc.detail, 2)
    return out


@chaos_cli.command("list")
def chaos_list(
    state: ExperimentState | None = typer.Option(None, help="Only experiments in this state."),
    as_json: bool = typer.Option(
        False, "--json", help="The items of GET /v1/admin/chaos/experiments, every page."
    ),
) -> None:
    """Every experiment, oldest first: its id (for `chaos report` and `chaos stop`), state,
    rounds and the GPUs in its blast radius."""
    rows: list[ExperimentSummaryOut] = []
    cursor = None
    with session_scope() as session:
        while True:
            items, cursor = chaos_service.list_experiments(
                session, PageParams(limit=500, cursor=cursor), state=state and state.value
            )
            rows += [ExperimentSummaryOut.model_validate(x) for x in items]
            if cursor is None:
                break
    if as_json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table("id", "name", "state", "rounds", "GPUs", "started", "stopped / next round")
    for r in rows:
        last = r.stopped_at or r.next_at
        table.add_row(
            str(r.id),
            r.name,
            r.state + (f" ({r.abort_reason})" if r.abort_reason else ""),
            str(r.rounds),
            str(r.gpus_touched),
            f"{r.started_at:%Y-%m-%d %H:%M:%S}",
            f"{last:%Y-%m-%d %H:%M:%S}" if last else "-",
        )
    console.print(table if rows else "No experiments.")


@chaos_cli.command("report")
def chaos_report(experiment: str, as_json: bool = typer.Option(False, "--json")) -> None:
    """An experiment's report: per fault, the health loop's times; the invariants."""
    try:
        with session_scope() as session:
            out = experiment_view(
                session, get_or_404(session, ChaosExperiment, experiment, what="experiment")
            )
    except AppError as exc:
        fail(exc.detail, 2)
    _chaos_print(out, as_json)


@chaos_cli.command("stop")
def chaos_stop(experiment: str) -> None:
    """Stop an experiment and undo what it injected."""
    try:
        with session_scope() as session:
            exp = get_or_404(
                session, ChaosExperiment, experiment, what="experiment", for_update=True
            )
            stop(session, exp)
            out = experiment_view(session, exp)
    except AppError as exc:
        fail(exc.detail, 2)
    _chaos_print(out, False)
