#!/usr/bin/env bash
# Reproduces the lifecycle figures in BENCHMARKS.md: submit-to-placed latency through the API,
# the outbox, Redis, Celery workers and PostgreSQL, with 1 then 2 workers over 2 regions, at
# each offered rate. Needs PostgreSQL and Redis (DATABASE_URL / REDIS_URL, default: the local
# ones); it creates and drops its own scratch database.
# Each rate runs with churn (every workload terminated through the API a second after it runs)
# and without (submissions only, the fleet sized to hold them all).
# Usage: benchmarks/lifecycle.sh [OUT_DIR] [DURATION] [RATES...]   (default: 15 s, 50 and 100/s)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
DURATION=${2:-15}
shift $(( $# > 2 ? 2 : $# ))
RATES=${*:-50 100}
RP=${RP:-.venv/bin/rackplane}
mkdir -p "$OUT"
: > "$OUT/lifecycle.jsonl"
for RATE in $RATES; do
  for CHURN in --churn --no-churn; do
    "$RP" bench lifecycle --workers 1,2 --rate "$RATE" --duration "$DURATION" --runs 3 \
      "$CHURN" --json | tee -a "$OUT/lifecycle.jsonl"
  done
done
