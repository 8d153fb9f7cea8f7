"""Kubernetes renderer: a placed workload as the Pods a real cluster would run, built from the
official `kubernetes` client models (which validate as they are built).

One Pod per replica, pinned to the node the core chose (`kubernetes.io/hostname`), asking the
NVIDIA device plugin for what the placement holds: `nvidia.com/gpu` (whole GPUs),
`nvidia.com/mig-<profile>` (a MIG slice, by the model's profile name) or `nvidia.com/gpu.shared`
(a time-sliced or MPS share). The exact GPU indices and MIG slot go in annotations for a DRA
driver or a topology-aware device plugin. VMs run as Kata pods (GPU passthrough; the
confidential runtime class for confidential VMs). A gang is a `List` of its Pods.

A gang is wired for distributed training: a headless Service names the first replica
(`MASTER_ADDR`, `MASTER_PORT`), and each Pod gets what torchrun, JAX and plain launchers read
(`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `PET_*` for torchrun's own
arguments, `JAX_*`), plus the topology it landed on (node, rack, NVLink domain). A gang whose
replicas share a multi-node NVLink domain (an NVL72 rack) gets the `ComputeDomain` NVIDIA's DRA
driver expects, each Pod claiming its IMEX channel.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client import (
    ApiClient,
    CoreV1ResourceClaim,
    V1Container,
    V1EnvVar,
    V1EnvVarSource,
    V1ObjectMeta,
    V1Pod,
    V1PodResourceClaim,
    V1PodSpec,
    V1ResourceRequirements,
    V1SecretKeySelector,
    V1Service,
    V1ServicePort,
    V1ServiceSpec,
    V1Toleration,
)

from app.models.workloads import Workload
from app.placement.mig import profile_name

DEFAULT_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
RUNTIME_CLASS = {"vm": "kata-qemu-nvidia-gpu", "confidential-vm": "kata-qemu-nvidia-gpu-snp"}
PRIORITY_CLASS = "rackplane-{}"
MASTER_PORT = 29500
IMEX_CLAIM = "imex-channel"


def _gang_env(w: Workload, p: dict[str, Any], master: str, domain: str) -> list[V1EnvVar]:
    """What a replica's launcher needs: ranks for one process per GPU (torchrun sets the
    per-process ones from PET_*; with one GPU per replica RANK and LOCAL_RANK are exact)."""
    per = len(p["gpu_indices"]) if not (p["mig_profile"] or w.shape.milli) else 1
    r = p["replica"]
    env = {
        "MASTER_ADDR": master,
        "MASTER_PORT": MASTER_PORT,
        "WORLD_SIZE": w.size * per,
        "LOCAL_WORLD_SIZE": per,
        "RANK": r * per,
        "LOCAL_RANK": 0,
        "GROUP_RANK": r,
        "PET_NNODES": w.size,
        "PET_NODE_RANK": r,
        "PET_NPROC_PER_NODE": per,
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": MASTER_PORT,
        "JAX_COORDINATOR_ADDRESS": f"{master}:{MASTER_PORT}",
        "JAX_NUM_PROCESSES": w.size,
        "JAX_PROCESS_ID": r,
        "RACKPLANE_NODE": p["node"],
        "RACKPLANE_RACK": p["rack"],
        "RACKPLANE_NVLINK_DOMAIN": domain,
    }
    return [V1EnvVar(name=k, value=str(v)) for k, v in env.items()]


def _resources(w: Workload, p: dict[str, Any]) -> dict[str, str]:
    s = w.shape
    out: dict[str, str] = {}
    if p["mig_profile"]:
        out[f"nvidia.com/mig-{profile_name(p['gpu_model'], p['mig_profile'])}"] = "1"
    elif s.milli:
        out["nvidia.com/gpu.shared"] = "1"
    else:
        out["nvidia.com/gpu"] = str(len(p["gpu_indices"]))
    if s.cpu_milli:
        out["cpu"] = f"{s.cpu_milli}m"
    if s.memory_mib:
        out["memory"] = f"{s.memory_mib}Mi"
    return out


def pods(
    w: Workload, tenant_slug: str, domains: dict[str, str] | None = None, imex: bool = False
) -> list[V1Pod]:
    """One Pod per replica. `domains`: each node's NVLink domain; `imex`: the replicas share a
    multi-node NVLink domain (they claim the ComputeDomain's IMEX channel)."""
    assert w.placement, "only a placed workload has a manifest"
    base = f"{tenant_slug}-{str(w.id)[:8]}"
    namespace = f"tenant-{tenant_slug}"
    gang = w.kind == "job"
    master = f"{base}-0.{base}.{namespace}.svc.cluster.local"
    domains = domains or {}
    out = []
    for p in sorted(w.placement, key=lambda p: p["replica"]):
        labels = _labels(w, tenant_slug, p)
        domain = domains.get(p["node"], p["node"])
        annotations = _annotations(w, p, domain)
        env = _env(w, p, gang, master, domain)
        spec = _pod_spec(w, p, base, gang, imex, env)
        out.append(
            V1Pod(
                api_version="v1",
                kind="Pod",
                metadata=V1ObjectMeta(
                    name=f"{base}-{p['replica']}",
                    namespace=namespace,
                    labels=labels,
                    annotations=annotations,
                ),
                spec=spec,
            )
        )
    return out


def _labels(w: Workload, tenant_slug: str, p: dict[str, Any]) -> dict[str, str]:
    """A replica's Pod labels: tenant, workload, tier, replica, and the workload's own."""
    return {
        "app.kubernetes.io/managed-by": "rackplane",
        "rackplane.dev/tenant": tenant_slug,
        "rackplane.dev/workload": str(w.id),
        "rackplane.dev/tier": w.tier,
        "rackplane.dev/replica": str(p["replica"]),
        **{f"user.rackplane.dev/{k}": v for k, v in (w.labels or {}).items()},
    }


def _annotations(w: Workload, p: dict[str, Any], domain: str) -> dict[str, str]:
    """Where a replica landed, for a DRA driver: GPU indices, rack, domain, MIG slot, share."""
    annotations = {
        "rackplane.dev/gpu-indices": ",".join(str(i) for i in p["gpu_indices"]),
        "rackplane.dev/rack": p["rack"],
        "rackplane.dev/nvlink-domain": domain,
    }
    if p["mig_profile"]:
        annotations["rackplane.dev/mig-slot"] = str(p["mig_slot"])
    if w.shape.milli:
        annotations["rackplane.dev/gpu-milli"] = str(w.shape.milli)
        annotations["rackplane.dev/gpu-memory-mib"] = str(w.shape.gpu_memory_mib)
    return annotations


def _env(w: Workload, p: dict[str, Any], gang: bool, master: str, domain: str) -> list[V1EnvVar]:
    """A replica's environment: rank, a gang's launcher variables, array element, secrets."""
    env = [
        V1EnvVar(name="RACKPLANE_RANK", value=str(p["replica"])),
        V1EnvVar(name="RACKPLANE_WORLD_SIZE", value=str(w.size)),
    ]
    if gang:
        env += _gang_env(w, p, master, domain)
    if w.array_id is not None:  # a job array's element, as its node agent would run it
        env += [
            V1EnvVar(name="RACKPLANE_ARRAY_ID", value=str(w.array_id)),
            V1EnvVar(name="RACKPLANE_ARRAY_INDEX", value=str(w.array_index)),
            V1EnvVar(name="RACKPLANE_ARRAY_COUNT", value=str(w.array_count)),
        ]
    # The tenant's secrets by reference: a Secret of that name with its value at `value`.
    env += [
        V1EnvVar(
            name=var,
            value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name=secret, key="value")),
        )
        for var, secret in sorted((w.secret_env or {}).items())
    ]
    return env


def _pod_spec(
    w: Workload, p: dict[str, Any], base: str, gang: bool, imex: bool, env: list[V1EnvVar]
) -> V1PodSpec:
    """A replica's Pod spec: a container asking for what it holds, pinned to its node."""
    res = _resources(w, p)
    claims = [CoreV1ResourceClaim(name=IMEX_CLAIM)] if imex else None
    container = V1Container(
        name="main",
        image=w.image or DEFAULT_IMAGE,
        resources=V1ResourceRequirements(limits=res, requests=res, claims=claims),
        env=env,
        ports=[{"containerPort": MASTER_PORT, "name": "rendezvous"}] if gang else None,
    )
    return V1PodSpec(
        hostname=f"{base}-{p['replica']}" if gang else None,
        subdomain=base if gang else None,
        resource_claims=[
            V1PodResourceClaim(name=IMEX_CLAIM, resource_claim_template_name=f"{base}-imex")
        ]
        if imex
        else None,
        containers=[container],
        node_selector={"kubernetes.io/hostname": p["node"]},
        tolerations=[V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
        restart_policy="Never" if w.kind == "job" else "Always",
        priority_class_name=PRIORITY_CLASS.format(w.priority),
        runtime_class_name=RUNTIME_CLASS.get(w.tier),
        active_deadline_seconds=w.max_runtime_s if w.kind == "job" else None,
    )


def manifest(
    w: Workload, tenant_slug: str, domains: dict[str, str] | None = None
) -> dict[str, Any]:
    """One Pod, or for a gang a `List`: its headless Service, its ComputeDomain when it spans
    nodes of one multi-node NVLink domain, and its Pods; as plain JSON."""
    api = ApiClient()
    domains = domains or {}
    nodes = {p["node"] for p in w.placement or []}
    shared = {domains.get(n, n) for n in nodes}
    imex = w.kind == "job" and len(nodes) > 1 and len(shared) == 1 and shared != nodes
    items = [api.sanitize_for_serialization(p) for p in pods(w, tenant_slug, domains, imex)]
    if w.kind != "job":
        return items[0]
    base = f"{tenant_slug}-{str(w.id)[:8]}"
    namespace = f"tenant-{tenant_slug}"
    service = V1Service(
        api_version="v1",
        kind="Service",
        metadata=V1ObjectMeta(name=base, namespace=namespace),
        spec=V1ServiceSpec(
            cluster_ip="None",  # headless: each Pod's hostname resolves
            selector={"rackplane.dev/workload": str(w.id)},
            ports=[V1ServicePort(name="rendezvous", port=MASTER_PORT)],
            publish_not_ready_addresses=True,
        ),
    )
    head: list[dict[str, Any]] = [api.sanitize_for_serialization(service)]
    if imex:  # NVIDIA's DRA driver: one IMEX domain for the gang's nodes
        head.append(
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomain",
                "metadata": {"name": f"{base}-cd", "namespace": namespace},
                "spec": {
                    "numNodes": len(nodes),
                    "channel": {"resourceClaimTemplate": {"name": f"{base}-imex"}},
                },
            }
        )
    return {"apiVersion": "v1", "kind": "List", "items": head + items}
