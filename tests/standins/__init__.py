"""Stand-ins for host tools the agent drives: `nvidia-smi` (bin/nvidia-smi) and `pynvml`, over
one JSON state file (`$RACKPLANE_FAKE_GPU_STATE`). See nvidia_smi.py."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = HERE / "bin"
