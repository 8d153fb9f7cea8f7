"""Variability-aware placement, measured: a fleet where 5 % of the GPUs run 20 % slow.

Gangs: a stream of 64-GPU gangs (8 replicas of 8 GPUs) among single-GPU inference and
fractional shares that come and go, on HGX H100 nodes. The same stream is placed twice by the
same engine and policy: once with the slow GPUs marked in the snapshot (variability-aware), once
with every GPU at nominal (blind). The figure is the share of gangs that land on at least one
slow GPU; a gang runs at its slowest member's pace. Blind placement lands 64 GPUs on slow ones
independently of their speed: about 1 - 0.95^64 = 96 % of gangs.

openb: the published replay (allocation at 130 % of capacity) with the same 5 % of GPUs marked
slow, against the same replay unmarked: what the speed preferences cost the packing.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from app.placement.engine import Engine, Plan
from app.placement.isolation import Tier
from app.placement.model import Request, Shape
from app.placement.policies import DEFAULT_POLICY, make_policy
from app.placement.snapshot import NodeSpec, Snapshot

SLOW_SHARE = 0.05
SLOW_PERF = 0.8


def mark_slow(nodes: list[NodeSpec], seed: int) -> tuple[list[NodeSpec], set[tuple[str, int]]]:
    """The same nodes with 5 % of their GPUs (drawn with `seed`) at 80 % speed."""
    rng = np.random.default_rng(seed)
    gpus = [(n.name, g) for n in nodes for g in range(n.gpus)]
    pick = rng.choice(len(gpus), size=round(SLOW_SHARE * len(gpus)), replace=False)
    slow = {gpus[int(i)] for i in pick}
    out = []
    for n in nodes:
        perf = tuple(SLOW_PERF if (n.name, g) in slow else 1.0 for g in range(n.gpus))
        out.append(replace(n, gpu_perf=perf) if SLOW_PERF in perf else n)
    return out, slow


def _fleet(nodes: int) -> list[NodeSpec]:
    return [
        NodeSpec(
            f"h{i:05d}",
            "H100-80GB",
            8,
            224_000,
            2048 * 1024,
            rack=f"rack{i // 32}",
            block=f"block{i // 256}",
        )
        for i in range(nodes)
    ]


def gangs(nodes: int = 256, seed: int = 1, policy: str = DEFAULT_POLICY) -> dict:
    """Share of gangs on at least one slow GPU, aware and blind, over one stream."""
    base = _fleet(nodes)
    marked, slow = mark_slow(base, seed)
    stream = _stream(nodes * 8, seed)
    out = {}
    for name, specs in (("aware", marked), ("blind", base)):
        snap = Snapshot(specs)
        engine = Engine(snap, make_policy(policy, seed=seed))
        plan = Plan(snap)
        live: list[list[int]] = []
        hit = placed = tried = 0
        for kind, item in stream:
            if isinstance(item, int):  # a departure
                if live:
                    i = item % len(live)
                    for aid in live.pop(i):
                        snap.release(aid)
                    snap.commit()
                continue
            o = engine.place_one(item, plan)
            snap.commit()
            if kind == "gang":
                tried += 1
                if o.placed:
                    placed += 1
                    hit += any((b.node, g) in slow for b in o.bindings for g in b.gpu_indices)
            elif o.placed:
                live.append([b.alloc_id for b in o.bindings])
        out[name] = {"gangs": tried, "placed": placed, "on_slow": hit}
    a, b = out["aware"], out["blind"]
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "slow_gpus": len(slow),
        "seed": seed,
        "policy": policy,
        "gangs": a["gangs"],
        "gangs_placed_aware": a["placed"],
        "gangs_placed_blind": b["placed"],
        "gangs_on_slow_pct_aware": round(100 * a["on_slow"] / max(1, a["placed"]), 2),
        "gangs_on_slow_pct_blind": round(100 * b["on_slow"] / max(1, b["placed"]), 2),
    }


def _stream(gpus: int, seed: int, load: float = 1.0) -> list[tuple[str, Request | int]]:
    """Arrivals until their GPU demand reaches `load` x the fleet, in shares of the demand:
    gangs 40 %, single GPUs 40 %, fractional shares 20 %; each arrival lets a random piece of
    small work leave with probability 0.3 (inference turns over; gangs stay)."""
    rng = np.random.default_rng(seed + 1000)
    weights = np.array([0.4 / 64, 0.4 / 1, 0.2 / 0.375])
    weights /= weights.sum()
    out: list[tuple[str, Request | int]] = []
    demand = 0.0
    i = 0
    while demand < load * gpus:
        i += 1
        kind = int(rng.choice(3, p=weights))
        if kind == 0:
            out.append(("gang", Request(f"g{i}", "t", Tier.DEDICATED, Shape(gpus=8), 8)))
            demand += 64
        elif kind == 1:
            out.append(("small", Request(f"s{i}", "t", Tier.DEDICATED, Shape(gpus=1))))
            demand += 1
        else:
            milli = int(rng.choice([250, 500]))
            out.append(("small", Request(f"f{i}", "t", Tier.TIMESLICE, Shape(milli=milli))))
            demand += milli / 1000
        if rng.random() < 0.3:
            out.append(("leave", int(rng.integers(1 << 30))))
    return out


def openb(nodes_file: Path, pods_file: Path, seeds: list[int], policy: str) -> dict:
    """The openb replay's allocation with 5 % of GPUs marked slow, against unmarked."""
    from rackplane_bench.sim import openb as ob

    nodes = ob.load_nodes(nodes_file)
    pods = ob.load_pods(pods_file)
    plain, marked = [], []
    start = time.perf_counter()
    for seed in seeds:
        plain.append(ob.replay(nodes, pods, policy, seed).alloc_pct_at_130)
        slow_nodes, _ = mark_slow(nodes, seed)
        marked.append(ob.replay(slow_nodes, pods, policy, seed).alloc_pct_at_130)
    return {
        "pods_file": pods_file.name,
        "seeds": seeds,
        "alloc_pct_unmarked": round(float(np.mean(plain)), 3),
        "alloc_pct_slow_marked": round(float(np.mean(marked)), 3),
        "alloc_loss_points": round(float(np.mean(plain) - np.mean(marked)), 3),
        "seconds": round(time.perf_counter() - start, 1),
    }
