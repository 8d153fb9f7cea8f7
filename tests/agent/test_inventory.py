"""The inventory: NVML (through a stand-in module here) or the YAML file, and its errors."""

from __future__ import annotations

import ctypes
import types

import pytest

from rackplane_agent import inventory as inv
from rackplane_agent.telemetry import NvmlSampler, Sample, render

pytestmark = pytest.mark.no_db


def _write(tmp_path, text: str):
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


GOOD = """
driver_version: "550.54.15"
cuda_version: "12.4"
gpus:
  - index: 0
    uuid: GPU-aaa
    model: H100-80GB
    memory_mib: 81559
    pci_bus_id: "00000000:18:00.0"
    mig_mode: true
    mig_instances:
      - {uuid: MIG-aaa-1, profile: 1g.10gb, start: 0}
      - {uuid: MIG-aaa-2, profile: 1g.10gb, start: 1}
  - {index: 1, uuid: GPU-bbb, model: H100-80GB}
"""


def test_the_file_with_the_agents_fields_filled_in(tmp_path):
    got = inv.from_file(
        _write(tmp_path, GOOD + "source: nvml\nruntimes: [podman]\n"),
        hostname="h1",
        address=None,
        runtimes=["process"],
    )
    assert got.source == "file" and got.hostname == "h1" and got.address
    assert got.runtimes == ["process"] and got.agent_version
    assert [g.uuid for g in got.gpus] == ["GPU-aaa", "GPU-bbb"]
    assert got.gpus[0].mig_instances[1].start == 1 and got.driver_version == "550.54.15"
    assert inv.device_ids(got) == {"GPU-aaa", "GPU-bbb", "MIG-aaa-1", "MIG-aaa-2"}
    # The file's own hostname and address win over the defaults; --address wins over both.
    text = GOOD + "hostname: file-host\naddress: 10.1.1.1\n"
    got = inv.from_file(_write(tmp_path, text), hostname="h1", address=None, runtimes=["process"])
    assert (got.hostname, got.address) == ("file-host", "10.1.1.1")
    got = inv.from_file(_write(tmp_path, text), hostname="h1", address="a", runtimes=["process"])
    assert got.address == "a"


@pytest.mark.parametrize(
    "text, message",
    [
        ("gpus: [", "not valid YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("{}", "gpus: Field required"),
        ("gpus:\n  - {index: 0, model: H100-80GB}\n", "gpus.0.uuid: Field required"),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, model: H100-80GB, memory_mb: 1}\n",
            "gpus[0].memory_mb",
        ),
        ("gpu: []\n", "unknown field(s): gpu"),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, model: X}\n  - {index: 1, uuid: GPU-a, model: X}\n",
            "GPU-a appears twice",
        ),
        (
            "gpus:\n  - {index: 0, uuid: GPU-a, model: X}\n  - {index: 0, uuid: GPU-b, model: X}\n",
            "index appears twice",
        ),
        ("gpus:\n  - {index: 300, uuid: GPU-a, model: X}\n", "gpus.0.index"),
    ],
)
def test_file_errors_are_clear(tmp_path, text, message):
    with pytest.raises(inv.InventoryError) as err:
        inv.from_file(_write(tmp_path, text), hostname="h", address=None, runtimes=["process"])
    assert message in str(err.value) and str(tmp_path) in str(err.value)


def test_neither_nvml_nor_a_file(tmp_path):
    with pytest.raises(inv.InventoryError, match="NVML did not load.*--inventory"):
        inv.collect(inventory_file=None, address=None, runtimes=["process"], nvml=None)
    with pytest.raises(inv.InventoryError, match="does not exist"):
        inv.collect(inventory_file=tmp_path / "nope.yaml", address=None, runtimes=["process"])


@pytest.mark.parametrize(
    "name, mib, model",
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA B200", 183359, "B200"),
        ("NVIDIA GB200", 189471, "GB200"),
        # PCIe cards by name (the `pcie` rack kind's models), not by a rounded memory size.
        ("NVIDIA L40S", 46068, "L40S-48GB"),
        ("NVIDIA L4", 23034, "L4-24GB"),
        ("NVIDIA RTX 6000 Ada Generation", 49140, "RTX6000Ada-48GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-PCIe-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-NVL-94GB"),
        ("NVIDIA H200 NVL", 143771, "H200-NVL-141GB"),
    ],
)
def test_fleet_model_names(name, mib, model):
    assert inv.fleet_model(name, mib) == model


class _Err(Exception):
    pass


class FakeNvml(types.SimpleNamespace):
    """Just enough of pynvml: two H100s, the first in MIG mode with one instance and in an
    NVLink fabric."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_GPU_FABRIC_STATE_COMPLETED = 3
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    nvmlEventTypeXidCriticalError = 8

    class c_nvmlGpuFabricInfo_t(ctypes.Structure):
        _fields_ = [
            ("clusterUuid", ctypes.c_uint8 * 16),
            ("status", ctypes.c_uint),
            ("cliqueId", ctypes.c_uint32),
            ("state", ctypes.c_uint),
        ]

    def __init__(self):
        super().__init__()
        self.events: list = []

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3 MIG 1g.10gb" if h[0] == "mig" else "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return f"MIG-{h[1]}-{h[2]}" if h[0] == "mig" else f"GPU-{h[1]}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=81559 * 1024 * 1024)

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=b"00000000:18:00.0")

    def nvmlDeviceGetMigMode(self, h):
        if h[1] == 0:
            return [1, 1]
        raise _Err("not supported")

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if i > 0:
            raise _Err("not found")
        return ("mig", h[1], i)

    def nvmlDeviceGetGpuInstanceId(self, h):
        return 5

    def nvmlDeviceGetGpuInstanceById(self, h, gi):
        return ("gi", gi)

    def nvmlGpuInstanceGetInfo(self, gi):
        return types.SimpleNamespace(placement=types.SimpleNamespace(start=3, size=1))

    def nvmlDeviceGetGpuFabricInfo(self, h, ref):
        if h[1] != 0:
            raise _Err("not supported")
        info = ref._obj
        info.clusterUuid[:] = list(range(1, 17))
        info.cliqueId = 32766
        info.state = 3

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 41

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetPowerUsage(self, h):
        return 123456

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, h, kinds, events):
        pass

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        if not self.events:
            raise _Err("timeout")
        return self.events.pop(0)

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlEventSetFree(self, events):
        pass


def test_nvml_inventory():
    got = inv.collect(
        inventory_file=None, address="10.0.0.9", runtimes=["process"], nvml=FakeNvml(), hostname="h"
    )
    assert got.source == "nvml" and got.driver_version == "550.54.15" and got.cuda_version == "12.4"
    g0, g1 = got.gpus
    assert (g0.uuid, g0.model, g0.memory_mib, g0.pci_bus_id) == (
        "GPU-0",
        "H100-80GB",
        81559,
        "00000000:18:00.0",
    )
    assert g0.mig_mode and [(m.uuid, m.profile, m.start) for m in g0.mig_instances] == [
        ("MIG-0-0", "1g.10gb", 3)
    ]
    assert g0.nvlink_clique == "01020304-0506-0708-090a-0b0c0d0e0f10/32766"
    assert not g1.mig_mode and g1.mig_instances == [] and g1.nvlink_clique is None


def test_nvml_telemetry_in_dcgm_names():
    nvml = FakeNvml()
    sampler = NvmlSampler(nvml, "node-1")
    nvml.events.append(types.SimpleNamespace(device=("gpu", 1), eventData=79))
    text = sampler.collect()
    assert "# TYPE DCGM_FI_DEV_GPU_TEMP gauge" in text
    assert 'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-0",Hostname="node-1"} 41' in text
    assert 'DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-1",Hostname="node-1"} 1980' in text
    assert 'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-0",Hostname="node-1"} 123.456' in text
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-1",Hostname="node-1"} 79' in text
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-0",Hostname="node-1"} 0' in text
    # The Xid is reported once; the next sample is back to 0.
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-1",Hostname="node-1"} 0' in sampler.collect()


def test_render_escapes_labels():
    text = render([Sample("DCGM_FI_DEV_GPU_TEMP", 0, 'GPU-"x"', 40.5)], "h")
    assert 'UUID="GPU-\\"x\\""' in text and text.endswith(" 40.5\n")
    assert render([], "h") == ""
