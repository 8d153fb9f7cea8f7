"""What every `rackplane` command shares: its consoles, how it fails, the checkout's paths, a
tenant by its slug and every page of a list."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.schemas import PageParams
from app.models.tenants import Tenant

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


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def tenant_id(session: Session, slug: str) -> uuid.UUID:
    """The tenant of this slug, or exit 2 saying there is none."""
    found = session.scalar(select(Tenant.id).where(Tenant.slug == slug))
    if found is None:
        fail(escape(f"no tenant {slug}"), 2)
    return found  # type: ignore[return-value]


def every_page(read: Callable[[PageParams], tuple[list[Any], str | None]]) -> list[Any]:
    """All rows of a paged list (`read(page)` -> rows, next cursor), 500 at a time."""
    rows: list[Any] = []
    page = PageParams(limit=500, cursor=None)
    while True:
        got, nxt = read(page)
        rows += got
        if nxt is None:
            return rows
        page = PageParams(limit=500, cursor=nxt)
