"""What every `rackplane` command shares: its consoles, how it fails, the checkout's paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
DEMO_FLEET = Path(__file__).resolve().parents[1] / "fleet" / "demo_fleet.yaml"


def _console(stderr: bool = False) -> Console:
    """On a terminal, its width. Piped or redirected, rich would cut tables and wrap lines at
    80 columns ("hgx-…", JSON split over lines): there every line is as long as what it holds,
    unless COLUMNS says otherwise."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, width=100_000 if piped else None)


console = _console()
err = _console(stderr=True)


def fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)
