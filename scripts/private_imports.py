"""A name that starts with `_` is its module's own: `make lint` fails when product code takes
one from another module, by import (`from x import _name`) or through an imported name
(`x._name`, `Thing._name`), so every name used across modules is public and has one path
(issue 48 §1). Tests may reach into a module; the product may not.

    python scripts/private_imports.py          # lists each use; exit 1 if there is any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "workers", "rackplane_agent", "rackplane_wire", "rackplane_bench")


def _ours(origin: str) -> bool:
    """Whether a name comes from our packages (the standard library's `os._exit` does not)."""
    return origin.split(".")[0] in PACKAGES


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def found() -> list[str]:
    """`path:line: name` for every private name product code takes from another module."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(ROOT)
            imported: dict[str, str] = {}  # local name -> where it came from
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    for alias in node.names:
                        if _private(alias.name):
                            out.append(f"{where}:{node.lineno}: {node.module}.{alias.name}")
                        imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        local = alias.asname or alias.name.split(".")[0]
                        imported[local] = alias.asname and alias.name or local
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and _private(node.attr)
                    and isinstance(node.value, ast.Name)
                    and _ours(imported.get(node.value.id, ""))
                ):
                    out.append(f"{where}:{node.lineno}: {imported[node.value.id]}.{node.attr}")
    return out


def main() -> int:
    uses = found()
    for line in uses:
        print(f"private name taken from another module (make it public, or move it): {line}")
    print(f"{len(uses)} private names taken across modules")
    return 1 if uses else 0


if __name__ == "__main__":
    sys.exit(main())
