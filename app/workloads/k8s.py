"""Kubernetes renderer: a placed workload as the Pods a real cluster would run, built from the
official `kubernetes` client models (which validate as they are built).

One Pod per replica, pinned to the node the core chose (`kubernetes.io/hostname`), asking the
NVIDIA device plugin for what the placement holds: `nvidia.com/gpu` (whole GPUs),
`nvidia.com/mig-<profile>` (a MIG slice, by the model's profile name) or `nvidia.com/gpu.shared`
(a time-sliced or MPS share). The exact GPU indices and MIG slot go in annotations for a DRA
driver or a topology-aware device plugin. VMs run as Kata pods (GPU passthrough; the
confidential runtime class for confidential VMs). A gang is a `List` of its Pods.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client import (
    ApiClient,
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
    V1Toleration,
)

from app.placement.mig import profile_name
from app.workloads.models import Workload

DEFAULT_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
RUNTIME_CLASS = {"vm": "kata-qemu-nvidia-gpu", "confidential-vm": "kata-qemu-nvidia-gpu-snp"}
PRIORITY_CLASS = "rackplane-{}"


def _resources(w: Workload, p: dict[str, Any]) -> dict[str, str]:
    s = w.shape
    out: dict[str, str] = {}
    if p["mig_profile"]:
        out[f"nvidia.com/mig-{profile_name(p['gpu_model'], p['mig_profile'])}"] = "1"
    elif s.get("milli"):
        out["nvidia.com/gpu.shared"] = "1"
    else:
        out["nvidia.com/gpu"] = str(len(p["gpu_indices"]))
    if s.get("cpu_milli"):
        out["cpu"] = f"{s['cpu_milli']}m"
    if s.get("memory_mib"):
        out["memory"] = f"{s['memory_mib']}Mi"
    return out


def pods(w: Workload, tenant_slug: str) -> list[V1Pod]:
    assert w.placement, "only a placed workload has a manifest"
    base = f"{tenant_slug}-{str(w.id)[:8]}"
    out = []
    for p in sorted(w.placement, key=lambda p: p["replica"]):
        labels = {
            "app.kubernetes.io/managed-by": "rackplane",
            "rackplane.dev/tenant": tenant_slug,
            "rackplane.dev/workload": str(w.id),
            "rackplane.dev/tier": w.tier,
            "rackplane.dev/replica": str(p["replica"]),
            **{f"user.rackplane.dev/{k}": v for k, v in (w.labels or {}).items()},
        }
        annotations = {
            "rackplane.dev/gpu-indices": ",".join(str(i) for i in p["gpu_indices"]),
            "rackplane.dev/rack": p["rack"],
        }
        if p["mig_profile"]:
            annotations["rackplane.dev/mig-slot"] = str(p["mig_slot"])
        if w.shape.get("milli"):
            annotations["rackplane.dev/gpu-milli"] = str(w.shape["milli"])
            annotations["rackplane.dev/gpu-memory-mib"] = str(w.shape["gpu_memory_mib"])
        res = _resources(w, p)
        env_rank = [
            {"name": "RACKPLANE_RANK", "value": str(p["replica"])},
            {"name": "RACKPLANE_WORLD_SIZE", "value": str(w.replicas)},
        ]
        container = V1Container(
            name="main",
            image=w.image or DEFAULT_IMAGE,
            resources=V1ResourceRequirements(limits=res, requests=res),
            env=env_rank,
        )
        spec = V1PodSpec(
            containers=[container],
            node_selector={"kubernetes.io/hostname": p["node"]},
            tolerations=[
                V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
            ],
            restart_policy="Never" if w.kind == "job" else "Always",
            priority_class_name=PRIORITY_CLASS.format(w.priority),
            runtime_class_name=RUNTIME_CLASS.get(w.tier),
            active_deadline_seconds=w.max_runtime_s if w.kind == "job" else None,
        )
        out.append(
            V1Pod(
                api_version="v1",
                kind="Pod",
                metadata=V1ObjectMeta(
                    name=f"{base}-{p['replica']}",
                    namespace=f"tenant-{tenant_slug}",
                    labels=labels,
                    annotations=annotations,
                ),
                spec=spec,
            )
        )
    return out


def manifest(w: Workload, tenant_slug: str) -> dict[str, Any]:
    """One Pod, or a `List` of Pods for a gang, as plain JSON."""
    api = ApiClient()
    items = [api.sanitize_for_serialization(p) for p in pods(w, tenant_slug)]
    if w.kind != "job":
        return items[0]
    return {"apiVersion": "v1", "kind": "List", "items": items}
