"""A name that starts with `_` is its module's own: `make lint` fails when product code imports
one from another module (`from x import _name`), so every name used across modules is public
and has one path (issue 48 §1). Tests may reach into a module; the product may not.

    python scripts/private_imports.py          # lists each import; exit 1 if any is new

`KNOWN` holds the imports that were there when the check came in, each to be made public or
moved where it is used; the list only shrinks (an entry no longer found is an error too, so it
is taken off)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "workers", "rackplane_agent", "rackplane_wire", "rackplane_bench")
KNOWN_FILE = ROOT / "scripts" / "private_imports.known"


def found() -> set[str]:
    """`path: module._name` for every private name product code imports from another module."""
    out = set()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        out.add(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    return out


def main() -> int:
    known = {
        line.strip()
        for line in KNOWN_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    now = found()
    new, gone = sorted(now - known), sorted(known - now)
    for line in new:
        print(f"private name imported across modules (make it public, or move it): {line}")
    for line in gone:
        print(f"no longer imported (take it off scripts/private_imports.known): {line}")
    print(f"{len(now)} private imports across modules ({len(known & now)} known, {len(new)} new)")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
