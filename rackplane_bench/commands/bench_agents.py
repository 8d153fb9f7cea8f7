"""`rackplane bench agents`: simulated node agents against one API process and a Celery worker
while work is submitted, on a scratch deployment."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from rackplane_bench.agents import QUICK_DURATION_S, median_run
from rackplane_bench.commands.common import emit, err

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class AgentsOptions:
    """`rackplane bench agents`'s options (their help is on bench_agents)."""

    agents: int
    duration: float
    rate: float | None
    warmup: float | None
    runs: int
    api_max_in_flight: int | None
    py_spy: Path | None
    api_app: str
    quick: bool
    as_json: bool


@cli.command("agents")
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
    execute(
        AgentsOptions(
            agents=agents,
            duration=duration,
            rate=rate,
            warmup=warmup,
            runs=runs,
            api_max_in_flight=api_max_in_flight,
            py_spy=py_spy,
            api_app=api_app,
            quick=quick,
            as_json=as_json,
        )
    )


def execute(opts: AgentsOptions) -> None:
    """The medians of --runs runs: a JSON object, or a table. Progress goes to stderr unless it
    is not a terminal and the answer is JSON."""
    duration = QUICK_DURATION_S if opts.quick and opts.duration == 60.0 else opts.duration
    log = (
        (lambda msg: err.print(msg))
        if not opts.as_json or sys.stderr.isatty()
        else (lambda m: None)
    )
    r = median_run(
        opts.runs,
        agents=opts.agents,
        duration=duration,
        rate=opts.rate,
        warmup=opts.warmup,
        api_max_in_flight=opts.api_max_in_flight,
        py_spy=opts.py_spy,
        api_app=opts.api_app,
        log=log,
    )
    if opts.as_json:
        emit(r, True)
    else:
        _summary(r)


def _summary(r: dict) -> None:
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
