#!/usr/bin/env bash
# Reproduces BENCHMARKS.md §7: `rackplane sim faults` on the 54-day Llama 3 setting (16,384 GPUs,
# three policies on the same faults), and effective training time by fleet size (4,096 to
# 100,000 GPUs, same per-GPU fault rate) with its plot. Pure replay: no services needed.
# About 2 minutes for the first, 15 for the sweep (two processes).
# Usage: benchmarks/goodput.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
RP=${RP:-.venv/bin/rackplane}
mkdir -p "$OUT"
"$RP" sim faults --gpus 16384 --days 54 --json | tee "$OUT/faults_16k.json"
"$RP" sim faults --gpus 4096,8192,16384,32768,65536,100000 --days 54 --json \
  --plot "$OUT/faults_fleet_size.png" | tee "$OUT/faults_fleet_size.json"
