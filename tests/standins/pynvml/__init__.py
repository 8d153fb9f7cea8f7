"""A stand-in `pynvml` over the stand-in nvidia-smi's state file (`$RACKPLANE_FAKE_GPU_STATE`):
only what `rackplane_agent.inventory` calls to read GPUs and their MIG instances, so the agent's
own NVML read path runs unchanged. Every call reads the file again (as NVML asks the driver).
Put `tests/standins` on PYTHONPATH to have `import pynvml` find it, or pass the module."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_rackplane_fake_smi", Path(__file__).resolve().parents[1] / "nvidia_smi.py"
)
assert _spec is not None and _spec.loader is not None
_smi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_smi)

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


def _state() -> dict:
    with _smi.locked(write=False) as state:
        return state


def _gpu(handle) -> dict:
    for g in _state()["gpus"]:
        if g["index"] == handle[1]:
            return g
    raise NVMLError_InvalidArgument(handle)


def _migs(g: dict) -> list[tuple[dict, dict]]:
    if not g["mig_current"]:
        return []
    return [(gi, ci) for gi in sorted(g["gis"], key=lambda x: x["id"]) for ci in gi["cis"]]


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return "550.54.15"


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    return 12040


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int):
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError_InvalidArgument(index)
    return ("gpu", index)


def _mig(handle) -> tuple[dict, dict, dict]:
    g = _gpu(handle)
    for gi, ci in _migs(g):
        if ci["uuid"] == handle[2]:
            return g, gi, ci
    raise NVMLError_NotFound(handle)


def nvmlDeviceGetName(handle) -> str:
    if handle[0] == "mig":
        g, gi, _ = _mig(handle)
        return f"{g['name']} MIG {gi['profile']}"
    return _gpu(handle)["name"]


def nvmlDeviceGetUUID(handle) -> str:
    return _mig(handle)[2]["uuid"] if handle[0] == "mig" else _gpu(handle)["uuid"]


def nvmlDeviceGetMemoryInfo(handle):
    return types.SimpleNamespace(total=_gpu(handle)["memory_mib"] * 1024 * 1024)


def nvmlDeviceGetPciInfo(handle):
    return types.SimpleNamespace(busId=_gpu(handle)["bus_id"].encode())


def nvmlDeviceGetMigMode(handle) -> list[int]:
    g = _gpu(handle)
    return [g["mig_current"], g["mig_pending"]]


def nvmlDeviceGetMaxMigDeviceCount(handle) -> int:
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(handle, index: int):
    migs = _migs(_gpu(handle))
    if not 0 <= index < len(migs):
        raise NVMLError_NotFound(index)
    return ("mig", handle[1], migs[index][1]["uuid"])


def nvmlDeviceGetGpuInstanceId(handle) -> int:
    return _mig(handle)[1]["id"]


def nvmlDeviceGetGpuInstanceById(handle, gi_id: int):
    for gi in _gpu(handle)["gis"]:
        if gi["id"] == gi_id:
            return ("gi", handle[1], gi_id)
    raise NVMLError_NotFound(gi_id)


def nvmlGpuInstanceGetInfo(gi_handle):
    g = _gpu(("gpu", gi_handle[1]))
    for gi in g["gis"]:
        if gi["id"] == gi_handle[2]:
            size = _smi.shapes(g["name"])[gi["profile"]][1]
            return types.SimpleNamespace(
                id=gi["id"], placement=types.SimpleNamespace(start=gi["start"], size=size)
            )
    raise NVMLError_NotFound(gi_handle)


def nvmlDeviceGetVbiosVersion(handle) -> str:
    return "96.00.89.00.01"
