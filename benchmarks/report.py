"""Render the openb comparison table of BENCHMARKS.md from benchmarks/results/*.jsonl.

Usage: python benchmarks/report.py [RESULTS_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Published FGD allocation % at 130% arrival (shared/traces/README.md).
PUBLISHED_FGD = {
    "default": 95.39,
    "gpushare40": 94.15,
    "gpushare60": 91.40,
    "gpushare80": 89.30,
    "gpushare100": 86.90,
    "multigpu20": 95.65,
    "multigpu30": 96.46,
    "multigpu40": 96.99,
    "multigpu50": 97.18,
}
LISTS = [
    "default",
    "gpushare20",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
]


def mean_line(path: Path) -> dict | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "mean_alloc_pct_at_130" in row:
            return row
    return None


def main(results: Path) -> None:
    print(
        "| pod list | published FGD | our FGD | Rackplane | vs published | vs our FGD "
        "| frag % at 90 (FGD / RP) | s per run (FGD / RP) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in LISTS:
        fgd = mean_line(results / f"openb_{name}_fgd.jsonl")
        rp = mean_line(results / f"openb_{name}_rackplane.jsonl")
        if not fgd or not rp:
            continue
        pub = PUBLISHED_FGD.get(name)
        f, r = fgd["mean_alloc_pct_at_130"], rp["mean_alloc_pct_at_130"]
        vs_pub = f"{r - pub:+.2f}" if pub else "–"
        print(
            f"| {name} | {pub if pub else '–'} | {f:.2f} ± {fgd['stdev_alloc_pct_at_130']:.2f} "
            f"| {r:.2f} ± {rp['stdev_alloc_pct_at_130']:.2f} | {vs_pub} | {r - f:+.2f} "
            f"| {fgd['mean_frag_ratio_at_90']:.1f} / {rp['mean_frag_ratio_at_90']:.1f} "
            f"| {fgd['mean_seconds']:.0f} / {rp['mean_seconds']:.0f} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results"))
