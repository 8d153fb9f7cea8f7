#!/usr/bin/env bash
# Reproduces the lifecycle figures in BENCHMARKS.md: submit-to-placed latency through the API,
# the outbox, Redis, Celery workers and PostgreSQL, with 1 then 2 workers over 2 regions.
# Needs PostgreSQL and Redis (DATABASE_URL / REDIS_URL, default: the local ones); it creates and
# drops its own scratch database. Usage: benchmarks/lifecycle.sh [OUT_DIR] [RATE] [DURATION]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
RATE=${2:-100}
DURATION=${3:-15}
RP=${RP:-.venv/bin/rackplane}
mkdir -p "$OUT"
"$RP" bench lifecycle --workers 1,2 --rate "$RATE" --duration "$DURATION" --runs 3 --json \
  | tee "$OUT/lifecycle_${RATE}per_s.jsonl"
