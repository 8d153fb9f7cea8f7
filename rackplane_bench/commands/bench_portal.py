"""`rackplane bench portal`: the operators' fleet heatmap of 100,000 GPUs in headless Chromium
against a real API on a scratch database."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from rackplane_bench.commands.common import emit
from rackplane_bench.portal import run

cli = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class PortalOptions:
    """`rackplane bench portal`'s options (their help is on bench_portal)."""

    runs: int
    frames: int
    as_json: bool


@cli.command("portal")
def bench_portal(
    runs: int = typer.Option(7, min=1, help="Page loads timed (after a warm-up)."),
    frames: int = typer.Option(60, min=2, help="Zoom and pan frames timed."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The operators' fleet heatmap of 100,000 GPUs in headless Chromium against a real API on
    a scratch PostgreSQL database: request to full first frame, frame time while zooming and
    panning, and the utilisation chart's query over that fleet (see rackplane_bench/portal.py)."""
    execute(PortalOptions(runs=runs, frames=frames, as_json=as_json))


def execute(opts: PortalOptions) -> None:
    emit(run(opts.runs, opts.frames), opts.as_json)
