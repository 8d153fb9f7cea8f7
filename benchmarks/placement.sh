#!/usr/bin/env bash
# Reproduces the placement figures in BENCHMARKS.md (openb replays and speed at scale).
# Usage: benchmarks/placement.sh [OUT_DIR] [SEEDS] [JOBS]
#   defaults: benchmarks/results, 42-51 (the published protocol's ten seeds), 2 processes.
# About 45 minutes on a 2-core machine; SEEDS=42-44 gives a quicker, noisier picture.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
SEEDS=${2:-42-51}
JOBS=${3:-2}
RP=${RP:-.venv/bin/rackplane}
TRACES=${TRACES:-../shared/traces/openb}
mkdir -p "$OUT"

run() {  # list policy [extra args]
  local list=$1 policy=$2; shift 2
  "$RP" sim openb --nodes "$TRACES/openb_node_list_gpu_node.csv" \
    --pods "$TRACES/openb_pod_list_$list.csv" --policy "$policy" --seeds "$SEEDS" \
    --jobs "$JOBS" --json "$@" > "$OUT/openb_${list}_${policy}.jsonl"
  tail -n 1 "$OUT/openb_${list}_${policy}.jsonl"
}

run default best-fit
run default fgd
run default rackplane --bound
for list in gpushare20 gpushare40 gpushare60 gpushare80 gpushare100 \
            multigpu20 multigpu30 multigpu40 multigpu50; do
  run "$list" fgd
  run "$list" rackplane
done

python benchmarks/report.py "$OUT"

for gpus in 10000 100000 1000000; do
  "$RP" bench placement --gpus "$gpus" --runs 3 --json | tee -a "$OUT/placement_speed.jsonl"
done
