"""Facts about the GPU models and rack kinds Rackplane sells (see shared/reference/gpu.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_mib: int
    architecture: str
    mig_capable: bool = True
    # Confidential computing support; Hopper multi-GPU CC claims the whole node's NVSwitches.
    confidential: bool = True
    cc_whole_node: bool = False
    # Maximum SM (boost) clock, MHz, from NVIDIA's datasheets, where we have it: the health
    # loop's nominal for "clock under load" (None: that evidence is not used for the model).
    sm_clock_mhz: int | None = None
    # nccl-tests all_reduce_perf bus bandwidth across the GPUs of one HGX node at large
    # messages (1-8 GB), GB/s, as published runs report it (8x H100 SXM 460-480, 8x A100 SXM
    # 230-250); burn-in's bound is 80 % of it ("more than 20 % below: something is off").
    # None: no published figure we trust (B200, GB200): the step checks only that it ran.
    nccl_busbw_gbps: float | None = None


GPU_MODELS: dict[str, GpuModel] = {
    m.name: m
    for m in (
        GpuModel(
            "A100-80GB",
            80 * 1024,
            "ampere",
            confidential=False,
            sm_clock_mhz=1410,
            nccl_busbw_gbps=240,
        ),
        GpuModel(
            "H100-80GB",
            80 * 1024,
            "hopper",
            cc_whole_node=True,
            sm_clock_mhz=1980,
            nccl_busbw_gbps=470,
        ),
        # The same NVLink-4 switch as H100.
        GpuModel(
            "H200-141GB",
            141 * 1024,
            "hopper",
            cc_whole_node=True,
            sm_clock_mhz=1980,
            nccl_busbw_gbps=470,
        ),
        GpuModel("B200", 180 * 1024, "blackwell"),
        GpuModel("GB200", 186 * 1024, "blackwell"),
        # PCIe cards (the `pcie` rack kind): NVIDIA's datasheets. Hopper PCIe cards have MIG
        # and per-GPU confidential computing (no NVSwitch to claim); Ada cards have neither.
        GpuModel("H100-PCIe-80GB", 80 * 1024, "hopper", sm_clock_mhz=1755),
        # MIG-capable in truth (1g.12gb ... 7g.94gb); not offered yet: one more group of
        # model-specific profile names in the workload schema's anyOf is more than the
        # schemathesis fuzzing of POST /v1/workloads can generate from (to rework).
        GpuModel("H100-NVL-94GB", 94 * 1024, "hopper", mig_capable=False, sm_clock_mhz=1785),
        GpuModel("H200-NVL-141GB", 141 * 1024, "hopper", sm_clock_mhz=1785),
        GpuModel(
            "L40S-48GB", 48 * 1024, "ada", mig_capable=False, confidential=False, sm_clock_mhz=2520
        ),
        GpuModel(
            "RTX6000Ada-48GB",
            48 * 1024,
            "ada",
            mig_capable=False,
            confidential=False,
            sm_clock_mhz=2505,
        ),
        GpuModel(
            "L4-24GB", 24 * 1024, "ada", mig_capable=False, confidential=False, sm_clock_mhz=2040
        ),
    )
}


@dataclass(frozen=True)
class RackKindSpec:
    name: str
    gpus_per_node: int
    nodes_per_rack: int | None  # None: any number of nodes
    gpu_models: tuple[str, ...]
    # Whether the whole rack is one NVLink domain (NVL72) or each node is its own (HGX).
    rack_is_nvlink_domain: bool
    default_cpu_milli: int
    default_memory_mib: int
    # GPUs a node may have besides `gpus_per_node` (HGX boards come with 4 GPUs, too).
    other_gpu_counts: tuple[int, ...] = ()


RACK_KINDS: dict[str, RackKindSpec] = {
    "nvl72": RackKindSpec("nvl72", 4, 18, ("GB200",), True, 144_000, 960 * 1024),
    "hgx": RackKindSpec(
        "hgx",
        8,
        None,
        ("H100-80GB", "H200-141GB", "B200", "A100-80GB"),
        False,
        224_000,
        2048 * 1024,
        other_gpu_counts=(4,),
    ),
    # PCIe servers: 1 to 10 cards of any model but the NVL72 tray's, each node its own NVLink
    # domain (at most bridged pairs inside it); what a cloud's single-GPU VM is, too.
    "pcie": RackKindSpec(
        "pcie",
        8,
        None,
        (
            "L4-24GB",
            "L40S-48GB",
            "RTX6000Ada-48GB",
            "H100-PCIe-80GB",
            "H100-NVL-94GB",
            "H200-NVL-141GB",
            "H100-80GB",
            "H200-141GB",
            "A100-80GB",
            "B200",
        ),
        False,
        64_000,
        512 * 1024,
        other_gpu_counts=(1, 2, 3, 4, 5, 6, 7, 9, 10),
    ),
}
