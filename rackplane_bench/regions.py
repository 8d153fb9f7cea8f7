"""`rackplane bench placement --regions N --workers 1,2 --api-processes 1,2`: placement across
processes (issue 38).

One scratch deployment per configuration (K Celery workers of one pool process each, the first
with beat; a uvicorn API of A processes) over a fleet of N regions of 8-GPU H100 nodes, sized
so capacity never runs out. Two measurements, in this order:

- **Submit-to-placed**: `rackplane bench lifecycle`'s open-loop load (`lifecycle.offer`), 1-GPU
  instances in turn over the N regions, each terminated a second after it runs; p50/p99 from
  sending the POST to the workload's `placing` event. It also warms the processes (pools,
  caches, each worker's kept copy of every region) before the next measurement.
- **Placement throughput**: once that load has drained, a backlog of queued workloads per
  region (1-GPU instances and every tenth a gang of 2 x 8 GPUs) is submitted through the
  workload service in one transaction from a child process, so every region's work appears at
  one commit and its kicks go out together. From that commit to the end of the last cycle that
  placed backlog work: `placed_per_s`. Each cycle's start and end come from the workers' JSON
  logs (`placement_cycle`: its timestamp, after the commit, and `seconds`), which show how
  many cycles of different regions ran at the same time on different workers. A cycle that
  finds its region held by another worker's cycle (PostgreSQL's advisory lock) logs
  `placement_cycle_busy` and hands over instead of deciding: `lock_refusals` (and
  `load_lock_refusals` during the load). `placed_twice`: workloads of the run with more than
  one `placing` event (none is preempted here, so any would be a double decision).

CPU of each process group over each measurement (the kernel's user + system time, in % of one
core: the machine has 200):
the API's processes, the workers' (with their pool and beat processes), PostgreSQL's, Redis's,
the bench's own process, and `other`: the rest of the machine's busy time (other sessions'
work on the same two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rackplane_bench.deploy import (
    ROOT,
    ScratchDeployment,
    postgres_pids,
    redis_pids,
    region_names,
)
from rackplane_bench.lifecycle import offer

GANG_EVERY = 10  # every tenth backlog workload is a gang
GANG = {"kind": "job", "gpus": 8, "replicas": 2}

# The child process that submits the backlog: the workload service (feasibility, both events,
# the placement kick) with the tenant key's AuthContext, in one transaction.
_SUBMIT = """
import json, sys, time
from sqlalchemy import select
from app.core.db import session_scope, utcnow
from app.models.keys import ApiKey
from app.models.tenants import Tenant
from app.tenancy.credentials import parse_prefix
from app.tenancy.principals import key_context
from app.workloads.schemas import WorkloadCreate
from app.workloads.service import submit

raw, bodies = sys.argv[1], json.load(sys.stdin)
with session_scope() as s:
    key = s.scalars(select(ApiKey).where(ApiKey.prefix == parse_prefix(raw))).one()
    auth, _ = key_context(s, key, s.get(Tenant, key.tenant_id), utcnow())
    for body in bodies:
        submit(s, auth, WorkloadCreate.model_validate(body))
print(json.dumps({"committed_at": time.time()}), flush=True)
"""


def backlog_bodies(regions: list[str], per_region: int) -> list[dict[str, Any]]:
    out = []
    for r in regions:
        for i in range(per_region):
            shape = GANG if i % GANG_EVERY == GANG_EVERY - 1 else {"kind": "instance", "gpus": 1}
            out.append({**shape, "name": f"backlog-{r}-{i}", "region": r, "max_runtime_s": 600})
    return out


def gpus_of(body: dict[str, Any]) -> int:
    return body["gpus"] * body.get("replicas", 1)


def run(
    regions: int,
    workers: int,
    api_processes: int,
    backlog: int,
    rate: float,
    duration: float,
    warmup: float,
) -> dict[str, Any]:
    import sqlalchemy as sa

    started = time.perf_counter()
    names = region_names(regions)
    bodies = backlog_bodies(names, backlog)
    # The backlog and every submission of the load held at once (the worst case), plus whole
    # free nodes for the gangs.
    load = -(-int(rate * (warmup + duration)) // regions)
    per_region = sum(gpus_of(b) for b in bodies) // regions + load
    env = ScratchDeployment(workers)
    try:
        key, db = env.seed(nodes_per_region=-(-per_region // 8) + 8, regions=regions)
        url = env.start(api_processes)
        groups = {
            "api": [env.procs[0].pid],
            "workers": [p.pid for p in env.procs[1:]],
        }
        engine = sa.create_engine(db)
        out: dict[str, Any] = {
            "regions": regions,
            "workers": workers,
            "api_processes": api_processes,
            "backlog": len(bodies),
            "backlog_gpus": sum(gpus_of(b) for b in bodies),
        }
        cpu0, t0, offsets = cpu_snapshot(groups), time.perf_counter(), log_offsets(env)
        lat = offer(env, url, key, rate, duration, True, warmup, names)
        wall = time.perf_counter() - t0
        cycles, busy = cycle_log(env, offsets, 0.0)
        parallel, _ = overlap([c for c in cycles if c[4]])
        out |= {
            "rate": rate,
            "submitted": lat["submitted"],
            "submit_to_placed_p50_ms": lat["p50_submit_to_placed_ms"],
            "submit_to_placed_p99_ms": lat["p99_submit_to_placed_ms"],
            "submit_api_p99_ms": lat["p99_submit_api_ms"],
            "load_placements_per_s": lat["placements_per_s"],
            "load_rejected": lat["rejected"],
            "load_parallel_pct": round(100 * parallel / wall, 1),
            "load_lock_refusals": busy,
        }
        out |= cpu_pct("load", cpu0, cpu_snapshot(groups), wall)
        settle(engine)
        out |= drain(env, engine, bodies, key, groups)
        with engine.connect() as c:
            out["placed_twice"] = c.scalar(
                sa.text(
                    "SELECT count(*) FROM (SELECT workload_id FROM workload_events "
                    "WHERE to_state = 'placing' GROUP BY workload_id HAVING count(*) > 1) t"
                )
            )
        out["seconds"] = round(time.perf_counter() - started, 1)
        engine.dispose()
        return out
    finally:
        env.close()


def settle(engine: Any, timeout: float = 60.0) -> None:
    """Wait until nothing of the load is still on its way to running, then for the kick keys
    it set to expire (`kicks.TTL_MS`), so the backlog's commit kicks every region afresh."""
    import sqlalchemy as sa

    keys_gone = time.time() + 2.5
    deadline = time.time() + timeout
    while time.time() < deadline:
        with engine.connect() as c:
            moving = c.scalar(
                sa.text(
                    "SELECT count(*) FROM workloads "
                    "WHERE state IN ('queued', 'placing', 'provisioning')"
                )
            )
        if not moving:
            break
        time.sleep(0.2)
    time.sleep(max(0.0, keys_gone - time.time()))


def drain(
    env: ScratchDeployment,
    engine: Any,
    bodies: list[dict[str, Any]],
    key: str,
    groups: dict[str, list[int]],
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Commit the backlog at once and time its placement (see the module's docstring)."""
    import sqlalchemy as sa

    offsets = log_offsets(env)
    child = subprocess.Popen(
        [sys.executable, "-c", _SUBMIT, key],
        cwd=ROOT,
        env=env.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child.stdin.write(json.dumps(bodies))
    child.stdin.close()
    line = child.stdout.readline()  # at the commit: the CPU window starts with placement
    cpu0, t0 = cpu_snapshot(groups), time.perf_counter()
    if child.wait() != 0 or not line:
        raise RuntimeError("the backlog's submission failed")
    committed = json.loads(line)["committed_at"]
    deadline = time.time() + timeout
    waiting = len(bodies)
    while waiting and time.time() < deadline:
        time.sleep(0.1)
        with engine.connect() as c:
            waiting = c.scalar(
                sa.text(
                    "SELECT count(*) FROM workloads "
                    "WHERE name LIKE 'backlog-%' AND state = 'queued'"
                )
            )
    cpu = cpu_pct("place", cpu0, cpu_snapshot(groups), time.perf_counter() - t0)
    time.sleep(0.3)  # the last cycle's log line
    cycles, busy = cycle_log(env, offsets, committed)
    deciding = [c for c in cycles if c[4]]
    last = max((c[3] for c in deciding), default=committed)
    span = max(last - committed, 1e-9)
    parallel, regions = overlap(deciding)
    return {
        "unplaced": waiting,
        "placed_per_s": round((len(bodies) - waiting) / span, 1),
        "place_s": round(span, 2),
        "cycles": len(cycles),
        "cycles_per_s": round(len([c for c in cycles if c[3] <= last]) / span, 1),
        "deciding_cycles": len(deciding),
        "cycle_ms_mean": round(1000 * sum(c[3] - c[2] for c in deciding) / max(len(deciding), 1)),
        "parallel_s": round(parallel, 2),
        "parallel_pct": round(100 * parallel / span, 1),
        "overlapping_regions": len(regions),
        "lock_refusals": busy,
        **cpu,
    }


Cycle = tuple[int, str, float, float, int]  # worker, region, start, end, workloads decided


def log_offsets(env: ScratchDeployment) -> list[int]:
    return [(Path(env.dir) / f"worker{i}.log").stat().st_size for i in range(env.workers)]


def cycle_log(env: ScratchDeployment, offsets: list[int], since: float) -> tuple[list[Cycle], int]:
    """The placement cycles the workers logged past `offsets` that ended at or after `since`
    (epoch seconds), and how many times a cycle found its region held by another's."""
    cycles: list[Cycle] = []
    busy = 0
    for i, offset in enumerate(offsets):
        with (Path(env.dir) / f"worker{i}.log").open("rb") as f:
            f.seek(offset)
            for line in f:
                if not line.startswith(b"{"):
                    continue  # Celery's own lines
                event = json.loads(line)
                if event.get("event") not in ("placement_cycle", "placement_cycle_busy"):
                    continue
                end = datetime.fromisoformat(event["timestamp"]).timestamp()
                if end < since:
                    continue
                if event["event"] == "placement_cycle_busy":
                    busy += 1
                else:
                    decided = event["admitted"] + event["evicted"] + event["blocked"]
                    cycles.append((i, event["region"], end - event["seconds"], end, decided))
    return cycles, busy


def overlap(cycles: list[Cycle]) -> tuple[float, set[str]]:
    """Seconds during which two or more of these cycles ran at once (each worker runs one at a
    time, so on different workers), and the regions whose cycle overlapped another region's
    cycle on another worker."""
    edges = sorted([(c[2], 1) for c in cycles] + [(c[3], -1) for c in cycles])
    parallel, running, since = 0.0, 0, 0.0
    for at, step in edges:
        if running >= 2:
            parallel += at - since
        running += step
        since = at
    regions = {
        a[1]
        for a in cycles
        for b in cycles
        if a[0] != b[0] and a[1] != b[1] and a[2] < b[3] and b[2] < a[3]
    }
    return parallel, regions


def cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """CPU seconds (user + system) by process, per group: the given process trees, this
    machine's PostgreSQL and Redis servers, this process alone, and the machine's busy time."""
    import psutil

    def tree(pids: list[int]) -> dict[int, float]:
        out: dict[int, float] = {}
        for pid in pids:
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    snap = {name: tree(pids) for name, pids in groups.items()}
    snap["postgres"] = tree(postgres_pids())
    snap["redis"] = tree(redis_pids())
    own = psutil.Process().cpu_times()
    snap["bench"] = {os.getpid(): own.user + own.system}
    m = psutil.cpu_times()
    snap["machine"] = {0: m.user + m.nice + m.system + m.irq + m.softirq + m.steal}
    return snap


def cpu_pct(
    phase: str, before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], wall: float
) -> dict[str, float]:
    """CPU used by each group between two snapshots, in % of one core (a process that started
    in between counts whole; one that ended is lost), and `other`: the machine's busy time left
    over."""
    used = {
        name: sum(t - before[name].get(pid, 0.0) for pid, t in after[name].items())
        for name in after
    }
    machine = used.pop("machine")
    out = {f"{phase}_cpu_pct_{name}": round(100 * s / wall, 1) for name, s in used.items()}
    out[f"{phase}_cpu_pct_other"] = round(100 * (machine - sum(used.values())) / wall, 1)
    return out
