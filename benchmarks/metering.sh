#!/usr/bin/env bash
# Reproduces the metering figures in BENCHMARKS.md: ledger ingestion rate on PostgreSQL and the
# time to produce a month's finance export for 10,000 tenants and 1,000,000 usage intervals.
# Needs PostgreSQL (DATABASE_URL, default the local one); it creates and drops its own scratch
# database. About 6 minutes on a 2-core machine (most of it loading and exporting the month).
# Usage: benchmarks/metering.sh [OUT_DIR] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
RUNS=${2:-3}
RP=${RP:-.venv/bin/rackplane}
mkdir -p "$OUT"
"$RP" bench metering --runs "$RUNS" --json | tee "$OUT/metering.json"
