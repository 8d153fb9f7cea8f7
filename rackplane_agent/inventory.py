"""What the host has (`rackplane_wire.Inventory`): read from NVML when a driver answers, else
from a YAML file (`--inventory FILE`, for hosts without GPUs: tests, demos, simulations).

The file has `Inventory`'s fields; `hostname` and `address` are optional (the agent fills them
in), `source`, `agent_version` and `runtimes` are the agent's own:

    driver_version: "550.54.15"
    cuda_version: "12.4"
    nccl_version: "2.21.5"            # optional, as are the next three
    firmware_version: "96.00.89.00.01"
    fabric_manager_version: "550.54.15"
    os_image: "ubuntu-22.04-gpu-2026.10"
    gpus:
      - index: 0
        uuid: GPU-5f8c...
        model: H100-80GB
        memory_mib: 81559
        pci_bus_id: "00000000:18:00.0"
        mig_mode: true
        mig_instances:
          - {uuid: MIG-1b2c..., profile: 1g.10gb, start: 0}
"""

from __future__ import annotations

import logging
import re
import socket
import uuid as uuidlib
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel

from rackplane_agent import __version__
from rackplane_agent.logfmt import kv
from rackplane_wire import TOKEN, GpuInfo, Inventory, MigInstance, RuntimeName

log = logging.getLogger("rackplane_agent.inventory")

_AGENT_FIELDS = ("source", "agent_version", "runtimes", "capabilities")
_MIG_PROFILE = re.compile(r"(\d+g\.\d+gb)", re.IGNORECASE)
_TOKEN = re.compile(TOKEN)


class InventoryError(Exception):
    """Neither NVML nor a usable inventory file."""


# --- the host --------------------------------------------------------------------------------


def default_hostname() -> str:
    return socket.gethostname()


def _resolves(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return any(not str(info[4][0]).startswith(("127.", "::1")) for info in infos)


def default_address() -> str:
    """The host's FQDN when it resolves to a non-loopback address, else its hostname."""
    fqdn = socket.getfqdn()
    if fqdn and fqdn != "localhost" and _resolves(fqdn):
        return fqdn
    return socket.gethostname()


def device_ids(inventory: Inventory) -> set[str]:
    """Every UUID a run may name in `devices`: the GPUs' and their MIG instances'."""
    ids = {g.uuid for g in inventory.gpus}
    ids |= {m.uuid for g in inventory.gpus for m in g.mig_instances}
    return ids


# --- the model name --------------------------------------------------------------------------

# Models the fleet names without a memory size; NVML's names carry the family.
_FIXED = {"GB200": "GB200", "GB300": "GB300", "B200": "B200", "B300": "B300", "H200": "H200-141GB"}


# PCIe cards, by the words of NVML's name (`NVIDIA H100 NVL`, `NVIDIA RTX 6000 Ada
# Generation`): the fleet names them apart from the SXM parts of the same family.
_CARDS = (
    (("H100", "NVL"), "H100-NVL-94GB"),
    (("H200", "NVL"), "H200-NVL-141GB"),
    (("H100", "PCIE"), "H100-PCIe-80GB"),
    (("RTX", "6000", "ADA"), "RTX6000Ada-48GB"),
    (("L40S",), "L40S-48GB"),
    (("L4",), "L4-24GB"),
)


def fleet_model(nvml_name: str, memory_mib: int) -> str:
    """NVML's product name -> the fleet's model name (`NVIDIA H100 80GB HBM3` -> `H100-80GB`,
    `NVIDIA A100-SXM4-80GB` -> `A100-80GB`, `NVIDIA GB200` -> `GB200`, `NVIDIA L4` ->
    `L4-24GB`)."""
    name = nvml_name.replace("NVIDIA", "").strip()
    words = set(re.split(r"[\s-]+", name.upper()))
    for needed, model in _CARDS:
        if words.issuperset(needed):
            return model
    family_match = re.search(r"\b(G?[A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.replace("-", " "))
    if family_match is None:
        return name.replace(" ", "-")[:64] or "unknown"
    family = family_match.group(1)
    if family in _FIXED:
        return _FIXED[family]
    size = re.search(r"(\d+)\s*GB", name)
    gb = int(size.group(1)) if size else round(memory_mib / 1024)
    return f"{family}-{gb}GB" if gb else family


# --- NVML ------------------------------------------------------------------------------------


def load_nvml() -> Any | None:
    """pynvml, initialised, when the library loads and a driver answers; else None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, OSError...
        log.debug(kv("nvml_unavailable", error=exc))
        return None
    return pynvml


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported, FunctionNotFound, ... on older GPUs/drivers
        return default


def _cuda_version(nvml: Any) -> str | None:
    v = _try(nvml.nvmlSystemGetCudaDriverVersion_v2)
    if v is None:
        v = _try(nvml.nvmlSystemGetCudaDriverVersion)
    if not isinstance(v, int) or v <= 0:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nvlink_clique(nvml: Any, handle: Any) -> str | None:
    """`<cluster UUID>/<clique id>` for a GPU in an NVLink fabric (GB200 NVL72)."""
    import ctypes

    struct = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
    if struct is None:
        return None
    info = struct()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except Exception:  # not an NVLink-fabric GPU, or an older driver
        return None
    if info.state != getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3):
        return None
    cluster = bytes(info.clusterUuid)
    if not any(cluster):
        return None
    return f"{uuidlib.UUID(bytes=cluster[:16])}/{info.cliqueId}"


def _mig_instances(nvml: Any, handle: Any) -> list[MigInstance]:
    out: list[MigInstance] = []
    count = _try(nvml.nvmlDeviceGetMaxMigDeviceCount, handle, default=0) or 0
    for i in range(count):
        mig = _try(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
        if mig is None:
            continue
        uuid = _try(nvml.nvmlDeviceGetUUID, mig)
        if not uuid:
            continue
        name = _s(_try(nvml.nvmlDeviceGetName, mig, default=""))
        m = _MIG_PROFILE.search(name)
        start = None
        gi_id = _try(nvml.nvmlDeviceGetGpuInstanceId, mig)
        if gi_id is not None:
            gi = _try(nvml.nvmlDeviceGetGpuInstanceById, handle, gi_id)
            info = _try(nvml.nvmlGpuInstanceGetInfo, gi) if gi is not None else None
            if info is not None:
                start = int(info.placement.start)
        out.append(
            MigInstance(
                uuid=_s(uuid),
                profile=m.group(1).lower() if m else "unknown",
                start=start if start is not None and 0 <= start <= 7 else None,
            )
        )
    return out[:7]


def gpus_from_nvml(nvml: Any) -> list[GpuInfo]:
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _s(nvml.nvmlDeviceGetName(h))
        memory = _try(nvml.nvmlDeviceGetMemoryInfo, h)
        memory_mib = int(memory.total) // (1024 * 1024) if memory is not None else 0
        pci = _try(nvml.nvmlDeviceGetPciInfo, h)
        mig_modes = _try(nvml.nvmlDeviceGetMigMode, h)
        mig_mode = bool(mig_modes and mig_modes[0] == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))
        gpus.append(
            GpuInfo(
                index=index,
                uuid=_s(nvml.nvmlDeviceGetUUID(h)),
                model=fleet_model(name, memory_mib),
                memory_mib=memory_mib,
                pci_bus_id=_s(pci.busId) if pci is not None else None,
                mig_mode=mig_mode,
                mig_instances=_mig_instances(nvml, h) if mig_mode else [],
                nvlink_clique=_nvlink_clique(nvml, h),
            )
        )
    return gpus


def _vbios(nvml: Any) -> str | None:
    """GPU 0's VBIOS version (a stack pins one per model; GPUs of a node share it)."""
    handle = _try(nvml.nvmlDeviceGetHandleByIndex, 0)
    if handle is None:
        return None
    value = _try(lambda: _s(nvml.nvmlDeviceGetVbiosVersion(handle)))
    return value if value and _TOKEN.match(value) else None


def _os_image(path: Path = Path("/etc/os-release")) -> str | None:
    """The OS image as /etc/os-release names it: IMAGE_ID-IMAGE_VERSION where the image says so
    (built images do), else ID-VERSION_ID."""
    try:
        fields = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    except OSError:
        return None
    values = {k: v.strip().strip('"') for k, v in fields.items()}
    for name, version in (("IMAGE_ID", "IMAGE_VERSION"), ("ID", "VERSION_ID")):
        if values.get(name):
            text = "-".join(v for v in (values[name], values.get(version)) if v)[:64]
            return text if _TOKEN.match(text) else None
    return None


def from_nvml(nvml: Any, *, hostname: str, address: str, runtimes: list[str]) -> Inventory:
    return Inventory(
        hostname=hostname,
        address=address,
        source="nvml",
        gpus=gpus_from_nvml(nvml),
        driver_version=_try(lambda: _s(nvml.nvmlSystemGetDriverVersion())),
        cuda_version=_cuda_version(nvml),
        firmware_version=_vbios(nvml),
        os_image=_os_image(),
        runtimes=cast(list[RuntimeName], runtimes),
        agent_version=__version__,
    )


# --- the file --------------------------------------------------------------------------------


def _unknown_keys(data: dict, model: type[BaseModel], where: str) -> list[str]:
    known = set(model.model_fields)
    return [f"{where}{k}" for k in data if k not in known]


def from_file(path: Path, *, hostname: str, address: str | None, runtimes: list[str]) -> Inventory:
    import yaml
    from pydantic import ValidationError

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise InventoryError(f"inventory file {path} does not exist") from None
    except OSError as exc:
        raise InventoryError(f"cannot read inventory file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"inventory file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"inventory file {path}: expected a mapping with `gpus`")
    unknown = _unknown_keys(data, Inventory, "")
    gpus = data.get("gpus")
    if isinstance(gpus, list):
        for i, g in enumerate(gpus):
            if isinstance(g, dict):
                unknown += _unknown_keys(g, GpuInfo, f"gpus[{i}].")
                for j, m in enumerate(g.get("mig_instances") or []):
                    if isinstance(m, dict):
                        unknown += _unknown_keys(m, MigInstance, f"gpus[{i}].mig_instances[{j}].")
    if unknown:
        raise InventoryError(f"inventory file {path}: unknown field(s): {', '.join(unknown)}")
    for key in _AGENT_FIELDS:
        data.pop(key, None)  # the agent's to say
    data.setdefault("hostname", hostname)
    if address:
        data["address"] = address
    if not data.get("address"):
        data["address"] = default_address()
    try:
        inv = Inventory(
            **data,
            source="file",
            runtimes=cast(list[RuntimeName], runtimes),
            agent_version=__version__,
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InventoryError(f"inventory file {path}: {problems}") from None
    seen: set[str] = set()
    for uuid in [g.uuid for g in inv.gpus] + [m.uuid for g in inv.gpus for m in g.mig_instances]:
        if uuid in seen:
            raise InventoryError(f"inventory file {path}: UUID {uuid} appears twice")
        seen.add(uuid)
    indexes = [g.index for g in inv.gpus]
    if len(set(indexes)) != len(indexes):
        raise InventoryError(f"inventory file {path}: a GPU index appears twice")
    return inv


def collect(
    *,
    inventory_file: Path | None,
    address: str | None,
    runtimes: list[str],
    nvml: Any | None = None,
    hostname: str | None = None,
) -> Inventory:
    """NVML when it loaded (`nvml`, from `load_nvml`), else the file, else InventoryError."""
    hostname = hostname or default_hostname()
    if nvml is not None:
        if inventory_file is not None:
            log.warning(kv("inventory_file_ignored", file=inventory_file, reason="NVML answered"))
        return from_nvml(
            nvml, hostname=hostname, address=address or default_address(), runtimes=runtimes
        )
    if inventory_file is None:
        raise InventoryError(
            "no GPU inventory: NVML did not load (no NVIDIA driver on this host) and no "
            "--inventory FILE was given"
        )
    return from_file(
        inventory_file,
        hostname=hostname,
        address=address or None,
        runtimes=runtimes,
    )
