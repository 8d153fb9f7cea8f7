#!/usr/bin/env bash
# Reproduces the GPU health loop's figures in BENCHMARKS.md §6: telemetry ingest through the API
# into PostgreSQL, recovery of gangs from an injected Xid 79 (API, worker, PostgreSQL, Redis, the
# simulated provider), and variability-aware placement (pure core, plus the openb replay).
# Needs PostgreSQL and Redis (DATABASE_URL, REDIS_URL; default the local ones). About 8 minutes.
# Usage: benchmarks/health.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
RP=${RP:-.venv/bin/rackplane}
mkdir -p "$OUT"
"$RP" bench telemetry --gpus 10000 --runs 3 --json | tee "$OUT/health_telemetry_10k.json"
"$RP" bench telemetry --gpus 100000 --rounds 3 --json | tee "$OUT/health_telemetry_100k.json"
"$RP" bench telemetry --gpus 10000 --batch-nodes 1 --rounds 2 --json | tee "$OUT/health_telemetry_per_node.json"
"$RP" bench recovery --json | tee "$OUT/health_recovery.json"
"$RP" bench placement --variability --json | tee "$OUT/health_variability.json"
