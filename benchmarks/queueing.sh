#!/usr/bin/env bash
# Reproduces the queueing figures in BENCHMARKS.md: the Philly replay of fifo, priority,
# Rackplane's default and strict-share on the same jobs, in one run.
# Usage: benchmarks/queueing.sh [OUT_DIR] [WINDOW] [NODES]
#   defaults: benchmarks/results, days 28:42 of the trace (its two busiest weeks), 64 8-GPU nodes.
#   POLICIES=a,b,...  the policies to replay; SHARE_CAP=X  the fair-share ceiling of every policy
#   but fifo and priority (a number >= 1, or none), saved to a file of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
WINDOW=${2:-28:42}
NODES=${3:-64}
RP=${RP:-.venv/bin/rackplane}
JOBS=${JOBS:-../shared/traces/philly/philly_jobs.csv}
POLICIES=${POLICIES:-fifo,priority,default,strict-share}
CAP=()
SUFFIX=""
if [[ -n "${SHARE_CAP:-}" ]]; then
  CAP=(--share-cap "$SHARE_CAP")
  SUFFIX="_cap${SHARE_CAP}"
fi
mkdir -p "$OUT"
"$RP" sim philly --jobs "$JOBS" --window "$WINDOW" --nodes "$NODES" --policy "$POLICIES" \
  ${CAP[@]+"${CAP[@]}"} --parallel 2 --json \
  | tee "$OUT/philly_${WINDOW/:/-}_${NODES}n${SUFFIX}.jsonl"
