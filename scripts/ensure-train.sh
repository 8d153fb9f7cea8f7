#!/usr/bin/env bash
# What the distributed-training tests and `rackplane bench ddp` need (issue 46):
# - iproute2's `ip`, for hosts made of network namespaces (rackplane_bench/hosts.py);
# - a Python with PyTorch that a run's own uid may execute: `.venv-train`, a venv of Debian's
#   /usr/bin/python3 (the project's .venv may live under a directory only root can enter), with
#   torch 2.13.0, the CPU build that pip installs offline on these machines from a wheel on
#   their disk (no download), and numpy beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
if ! command -v ip >/dev/null 2>&1; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq iproute2
fi
TRAIN=.venv-train
if ! [[ -x $TRAIN/bin/python ]] || ! $TRAIN/bin/python -c "import torch" 2>/dev/null; then
  if ! /usr/bin/python3 -m venv --help >/dev/null 2>&1 || ! /usr/bin/python3 -c "import ensurepip" 2>/dev/null; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq python3-venv
  fi
  rm -rf "$TRAIN"
  /usr/bin/python3 -m venv "$TRAIN"
  "$TRAIN/bin/python" -m pip install -q "torch==2.13.0" "numpy>=1.26,<3" 2>&1 | grep -v "^WARNING: Location" || true
  "$TRAIN/bin/python" -c "import torch, torch.distributed as d; assert d.is_gloo_available(); print('torch', torch.__version__)"
fi
chmod -R a+rX "$TRAIN"
