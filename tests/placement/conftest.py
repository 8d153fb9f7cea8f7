"""Builders for placement tests. No database: the placement core is pure."""

from __future__ import annotations

import pytest

from app.placement.isolation import Tier
from app.placement.model import Level, Request, Shape, Topology
from app.placement.snapshot import NodeSpec, Snapshot


@pytest.fixture(autouse=True)
def clean_db():
    """Override the service tests' database cleaner: nothing here touches a database."""
    yield


def node(
    name: str,
    gpus: int = 8,
    model: str = "H100-80GB",
    *,
    rack: str | None = None,
    block: str | None = None,
    domain: str | None = None,
    cpu: int = 224_000,
    mem: int = 2_048_000,
    mig: tuple[int, ...] = (),
    perf: float = 1.0,
    health: tuple[int, ...] | None = None,
    schedulable: bool = True,
    region: str = "r1",
) -> NodeSpec:
    return NodeSpec(
        name=name,
        model=model,
        gpus=gpus,
        cpu_milli=cpu,
        mem_mib=mem,
        region=region,
        rack=rack or name,
        block=block,
        domain=domain,
        mig_gpus=mig,
        perf=perf,
        gpu_health=health,
        schedulable=schedulable,
    )


def nvl72(
    rack: str, *, block: str | None = None, region: str = "r1", perf: float = 1.0
) -> list[NodeSpec]:
    """A GB200 NVL72 rack: 18 trays of 4 GPUs, one NVLink domain."""
    return [
        node(
            f"{rack}-t{i:02d}",
            4,
            "GB200",
            rack=rack,
            block=block,
            domain=rack,
            cpu=144_000,
            mem=983_040,
            region=region,
            perf=perf,
        )
        for i in range(18)
    ]


def hgx(
    prefix: str,
    count: int,
    *,
    model: str = "H100-80GB",
    rack: str | None = None,
    block: str | None = None,
    **kw,
) -> list[NodeSpec]:
    rack = rack or f"{prefix}rack"
    return [node(f"{prefix}{i:03d}", 8, model, rack=rack, block=block, **kw) for i in range(count)]


def snap(*groups) -> Snapshot:
    nodes: list[NodeSpec] = []
    for g in groups:
        nodes += g if isinstance(g, list) else [g]
    return Snapshot(nodes)


def whole(
    rid: str,
    gpus: int = 1,
    *,
    tenant: str = "t1",
    tier: Tier = Tier.DEDICATED,
    replicas: int = 1,
    topology: Topology | None = None,
    models=None,
    cpu: int = 1000,
    mem: int = 1024,
) -> Request:
    return Request(
        rid,
        tenant,
        tier,
        Shape(gpus=gpus, cpu_milli=cpu, mem_mib=mem, models=frozenset(models) if models else None),
        replicas=replicas,
        topology=topology,
    )


def mig(
    rid: str, profile: str, *, tenant: str = "t1", tier: Tier = Tier.MIG_SHARED, models=None
) -> Request:
    return Request(
        rid,
        tenant,
        tier,
        Shape(
            mig=profile, cpu_milli=1000, mem_mib=1024, models=frozenset(models) if models else None
        ),
    )


def share(
    rid: str, milli: int, *, tenant: str = "t1", tier: Tier = Tier.MPS, gmem: int = 1024
) -> Request:
    return Request(
        rid, tenant, tier, Shape(milli=milli, gpu_mem_mib=gmem, cpu_milli=500, mem_mib=512)
    )


def required(level: Level) -> Topology:
    return Topology(level, True)


def preferred(level: Level) -> Topology:
    return Topology(level, False)
