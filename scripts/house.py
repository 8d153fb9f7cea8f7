"""The house's figures, from the source: package cycles, imports inside functions, big rooms.

    python scripts/house.py [--json] [ROOT ...]

Each ROOT (default: `app`, `rackplane_agent` and `rackplane_bench`) is measured on its own. A
package is a folder directly under ROOT or a module there (`app/main.py`). A big room is a
file over MAX_FILE_LINES or a function over MAX_FUNCTION_LINES (issue 48's bounds).
An import between packages is counted where it is written: at module level, or
inside a function (how a cycle hides). A cycle is a strongly connected set of packages.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path


def package_of(module: str, root: str) -> str | None:
    parts = module.split(".")
    if parts[0] != root or len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path, base: Path) -> str:
    rel = path.relative_to(base).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.Module, module: str, is_package: bool):
    """(imported module, inside a function?, line) for each import in a module."""
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    base = base[: len(base) - child.level + (1 if is_package else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                # `from app import x` names a package through its attribute.
                if target.count(".") == 0:
                    found.extend(
                        (f"{target}.{a.name}", in_function, child.lineno) for a in child.names
                    )
                else:
                    found.append((target, in_function, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out, key=len, reverse=True)


MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def measure(root: Path) -> dict:
    base = root.parent
    name = root.name
    all_edges: dict[str, set[str]] = defaultdict(set)
    module_edges: dict[str, set[str]] = defaultdict(set)
    between = inside = 0
    inside_at: list[str] = []
    big_files: list[tuple[str, int]] = []
    long_functions: list[tuple[str, int]] = []
    packages: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        module = module_name(path, base)
        here = package_of(module, name)
        if here is None:
            continue
        packages.add(here)
        lines = source.count("\n")
        if lines > MAX_FILE_LINES:
            big_files.append((str(path.relative_to(base)), lines))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append((f"{path.relative_to(base)}:{node.name}", length))
        for target, in_function, line in imports(tree, module, path.name == "__init__.py"):
            there = package_of(target, name)
            if there is None or there == here:
                continue
            between += 1
            all_edges[here].add(there)
            if in_function:
                inside += 1
                inside_at.append(f"{path.relative_to(base)}:{line} -> {target}")
            else:
                module_edges[here].add(there)
    every = cycles(all_edges)
    module_level = cycles(module_edges)
    return {
        "packages": len(packages),
        "imports_between_packages": between,
        "imports_inside_functions": inside,
        "inside_share": round(inside / between, 3) if between else 0.0,
        "cycles_all_imports": every,
        "packages_in_cycles_all_imports": sum(len(c) for c in every),
        "cycles_module_level": module_level,
        "files_over_800_lines": sorted(big_files, key=lambda f: -f[1]),
        "functions_over_80_lines": sorted(long_functions, key=lambda f: -f[1]),
        "imports_inside_functions_at": inside_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("roots", nargs="*", default=["app", "rackplane_agent", "rackplane_bench"])
    parser.add_argument("--json", action="store_true", help="everything, as JSON")
    args = parser.parse_args()
    every = {root: measure(Path(root).resolve()) for root in args.roots}
    if args.json:
        print(json.dumps(every, indent=2))
        return
    for root, figures in every.items():
        report(root, figures)


def report(root: str, figures: dict) -> None:
    print(f"== {root}")
    print(f"packages: {figures['packages']}")
    print(
        f"imports between packages: {figures['imports_between_packages']}, "
        f"inside functions: {figures['imports_inside_functions']} ({figures['inside_share']:.1%})"
    )
    print(f"cycles counting every import: {len(figures['cycles_all_imports'])}")
    for c in figures["cycles_all_imports"]:
        print(f"  {len(c)}: {' '.join(c)}")
    print(f"cycles from module-level imports: {len(figures['cycles_module_level'])}")
    for c in figures["cycles_module_level"]:
        print(f"  {len(c)}: {' '.join(c)}")
    print(f"files over {MAX_FILE_LINES} lines: {len(figures['files_over_800_lines'])}")
    for f, n in figures["files_over_800_lines"]:
        print(f"  {n:5d} {f}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(figures['functions_over_80_lines'])}")
    for f, n in figures["functions_over_80_lines"]:
        print(f"  {n:5d} {f}")


if __name__ == "__main__":
    main()
