"""What the command modules share: where the public traces are, the error console, printing a
result, and reading seed ranges."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

# The public traces, beside the checkout (shared/traces/README.md).
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"

err = Console(stderr=True)


def parse_seeds(seed: int, seeds: str | None) -> list[int]:
    """The seeds of a run: `seed` alone, or every seed of ranges such as `42-51,60`."""
    if not seeds:
        return [seed]
    out: list[int] = []
    for part in seeds.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def emit(obj: dict, as_json: bool) -> None:
    """One result on stdout: a JSON object, or `key=value` pairs."""
    if as_json:
        print(json.dumps(obj), flush=True)
    else:
        print("  ".join(f"{k}={v}" for k, v in obj.items()), flush=True)
