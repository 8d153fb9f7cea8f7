"""Speed of the placement core at fleet scale (`rackplane bench placement`).

A synthetic fleet mixes GB200 NVL72 racks (one NVLink domain of 72 GPUs each) and HGX
H100/H200 nodes (8 GPUs, some with MIG GPUs), grouped in blocks of 8 racks, preloaded to about
half its GPUs. On one core it measures whole-GPU, MIG and fractional placements per second, the
p50/p99 time to place a 64-GPU gang with `required: nvlink_domain`, the snapshot build time and
the memory the snapshot holds (traced), and the process's peak resident memory.
"""

from __future__ import annotations

import gc
import resource
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from app.placement.engine import Engine, Plan
from app.placement.isolation import Tier
from app.placement.model import Level, Request, Shape, Topology
from app.placement.policies import DEFAULT_POLICY, make_policy
from app.placement.snapshot import NodeSpec, Snapshot

NVL72_SHARE = 0.4  # of the GPUs
CANDIDATE_LIMIT = 8


def synthetic_fleet(gpus: int, seed: int = 0) -> list[NodeSpec]:
    rng = np.random.default_rng(seed)
    nodes: list[NodeSpec] = []
    racks = max(1, round(gpus * NVL72_SHARE / 72))
    for r in range(racks):
        block = f"blk{r // 8}"
        for t in range(18):
            nodes.append(
                NodeSpec(
                    f"nvl{r:05d}-t{t:02d}",
                    "GB200",
                    4,
                    144_000,
                    983_040,
                    region="bench",
                    rack=f"nvl{r:05d}",
                    block=block,
                    domain=f"nvl{r:05d}",
                )
            )
    hgx_nodes = max(1, (gpus - racks * 72) // 8)
    for i in range(hgx_nodes):
        model = "H100-80GB" if i % 2 == 0 else "H200-141GB"
        rack = f"hgx{i // 4:05d}"  # 4 HGX nodes per rack
        mig = (6, 7) if rng.random() < 0.25 else ()
        perf = 0.85 if rng.random() < 0.02 else 1.0  # a few slow nodes
        nodes.append(
            NodeSpec(
                f"h{i:06d}",
                model,
                8,
                224_000,
                2_097_152,
                region="bench",
                rack=rack,
                block=f"hblk{i // 32}",
                mig_gpus=mig,
                perf=perf,
            )
        )
    return nodes


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def preload(snap: Snapshot, fraction: float, seed: int = 0) -> None:
    """Occupy about `fraction` of the GPUs directly (whole GPUs, some shares), bypassing policy."""
    rng = np.random.default_rng(seed)
    tenant = snap.tenant_id("preload")
    # Occupancy varies by rack (uniform around `fraction`), so some NVLink domains are nearly
    # empty and others nearly full, as on a real fleet.
    racks = snap.node_level[Level.RACK]
    rack_frac = rng.uniform(0, 2 * fraction, size=int(racks.max()) + 1).clip(0, 1)
    for n in range(len(snap.node_names)):
        free = snap.whole_free_slots(n)
        take = int(round(len(free) * rack_frac[racks[n]]))
        take = min(take, len(free))
        if take:
            snap.allocate(
                tenant, Tier.DEDICATED, n, tuple(free[:take]), cpu=1000 * take, mem=1024 * take
            )
        rest = snap.whole_free_slots(n)
        if rest and rng.random() < 0.1:
            snap.allocate(
                tenant, Tier.MPS, n, (rest[0],), milli=300, gpu_mem=1024, cpu=500, mem=512
            )
    snap.commit()


@dataclass
class BenchResult:
    gpus: int
    nodes: int
    snapshot_build_s: float
    snapshot_mib: float
    max_rss_mib: float
    whole_per_s: float
    mig_per_s: float
    fractional_per_s: float
    gang64_p50_ms: float
    gang64_p99_ms: float
    gang64_placed: int
    policy: str

    def as_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in vars(self).items()}


def _rate(engine: Engine, reqs: list[Request]) -> float:
    plan = Plan(engine.snap)
    placed = 0
    start = time.perf_counter()
    for r in reqs:
        plan.outcomes.append(engine.place_one(r, plan))
        engine.snap.commit()
        placed += bool(plan.outcomes[-1].placed) if plan.outcomes else 0
    elapsed = time.perf_counter() - start
    return placed / elapsed


def _snapshot(nodes: list[NodeSpec]) -> tuple[Snapshot, float, float]:
    """The fleet's snapshot, the seconds its build took, and the MiB it holds."""
    # Memory the snapshot holds (arrays and indexes), traced on a separate build so the
    # tracing does not slow the timed one.
    tracemalloc.start()
    traced = Snapshot(nodes)
    held, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del traced
    gc.collect()
    t0 = time.perf_counter()
    snap = Snapshot(nodes)
    build = time.perf_counter() - t0
    return snap, build, held / 2**20


def _requests(
    placements: int, tenants: list[str], rng: np.random.Generator
) -> tuple[list[Request], list[Request], list[Request]]:
    """The timed placements of each kind: whole GPUs, MIG slices, fractional shares."""
    # Customers name the GPU model they want; rotate over the fleet's models.
    hgx = [frozenset({"H100-80GB"}), frozenset({"H200-141GB"})]
    every = [frozenset({"GB200"}), *hgx]
    whole = [
        Request(
            f"w{i}",
            tenants[i % 20],
            Tier.DEDICATED,
            Shape(gpus=1, cpu_milli=4000, mem_mib=16384, models=every[i % 3]),
        )
        for i in range(placements)
    ]
    migs = [
        Request(
            f"m{i}",
            tenants[i % 20],
            Tier.MIG_SHARED,
            Shape(
                mig=str(rng.choice(["1g", "2g", "3g"])),
                cpu_milli=2000,
                mem_mib=8192,
                models=every[i % 3],
            ),
        )
        for i in range(placements)
    ]
    fracs = [
        Request(
            f"f{i}",
            tenants[i % 20],
            Tier.MPS,
            Shape(
                milli=int(rng.choice([100, 250, 500])),
                gpu_mem_mib=8192,
                cpu_milli=1000,
                mem_mib=4096,
                models=every[i % 3],
            ),
        )
        for i in range(placements)
    ]
    return whole, migs, fracs


def _gangs(engine: Engine, gangs: int, tenants: list[str]) -> tuple[list[float], int]:
    """Each 64-GPU gang's placement time (seconds), and how many were placed."""
    snap = engine.snap
    times, placed = [], 0
    gang_shape = Shape(gpus=4, cpu_milli=16000, mem_mib=65536, models=frozenset({"GB200"}))
    for i in range(gangs):
        req = Request(
            f"g{i}",
            tenants[i % 20],
            Tier.DEDICATED,
            gang_shape,
            replicas=16,
            topology=Topology(Level.NVLINK_DOMAIN, True),
        )
        plan = Plan(snap)
        t = time.perf_counter()
        out = engine.place_one(req, plan)
        times.append(time.perf_counter() - t)
        if out.placed:
            placed += 1
            for b in out.bindings:  # give the capacity back so every gang sees a similar fleet
                snap.release(b.alloc_id)
        snap.commit()
    return times, placed


def run(
    gpus: int,
    *,
    placements: int = 2000,
    gangs: int = 100,
    seed: int = 0,
    policy: str = DEFAULT_POLICY,
) -> BenchResult:
    """Build and preload the fleet; time each kind of placement, then the gangs."""
    gc.collect()
    nodes = synthetic_fleet(gpus, seed)
    snap, build, rss = _snapshot(nodes)
    del nodes
    preload(snap, 0.5, seed)
    pol = make_policy(policy, seed=seed)
    pol.candidate_limit = CANDIDATE_LIMIT
    engine = Engine(snap, pol, candidate_limit=CANDIDATE_LIMIT)
    rng = np.random.default_rng(seed)
    tenants = [f"t{i}" for i in range(20)]
    whole, migs, fracs = _requests(placements, tenants, rng)
    engine.place_one(whole[0], Plan(snap))  # warm caches
    snap.commit()
    whole_rate = _rate(engine, whole[1:])
    mig_rate = _rate(engine, migs)
    frac_rate = _rate(engine, fracs)
    times, placed = _gangs(engine, gangs, tenants)
    ms = np.array(times) * 1000
    return BenchResult(
        snap.gpu_count,
        len(snap.node_names),
        build,
        rss,
        _max_rss_mib(),
        whole_rate,
        mig_rate,
        frac_rate,
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 99)),
        placed,
        policy,
    )
