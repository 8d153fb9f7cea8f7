"""`rackplane bench recovery`: Xid 79 injected on one GPU of running 8x8 gangs, through the real
path (API, worker, PostgreSQL, Redis, the simulated provider with its default boot time).

A 10k-GPU fleet (HGX H100 x8) is filled half: 8x8 gangs (64 GPUs each) and 8-GPU instances.
Each gang reports a checkpoint; then, one gang at a time, the benchmark pushes dcgm-exporter
text with Xid 79 on one of its GPUs (dated by the sample) and waits for the gang to run again.
From the gang's own events and the usage ledger it measures:
- fault_to_requeued: the sample's instant to the expedited "queued" transition being written;
- fault_to_running: the sample's instant to the gang's next "running" transition;
- lost work: recorded on the workload, against 64 x (fault instant - last checkpoint);
- usage after the fault: any usage of the gang's allocations past the fault instant;
- double allocations: live allocations sharing a GPU, and allocation histories that overlap on
  one GPU (whole GPUs), over the whole run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from rackplane_bench.deploy import ScratchDeployment, pct
from rackplane_bench.telemetry import make_key, platform_key, seed_fleet

GANG = {"kind": "job", "gpus": 8, "replicas": 8, "checkpoint": {"interval_s": 600}}


def _xid_text(host: str, gpu: int, code: int, ts_ms: int) -> bytes:
    labels = (
        f'gpu="{gpu}",UUID="GPU-bench-{host}-{gpu}",device="nvidia{gpu}",'
        f'modelName="NVIDIA H100 80GB HBM3",Hostname="{host}"'
    )
    return (
        "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.\n"
        "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
        f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} {code} {ts_ms}\n"
    ).encode()


def _at(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


@dataclass
class _Tally:
    """What the faults measured so far (see the module's docstring)."""

    to_requeued: list[float] = field(default_factory=list)
    to_running: list[float] = field(default_factory=list)
    lost_err: list[float] = field(default_factory=list)
    lost: float = 0.0
    expected: float = 0.0
    billed_after: int = 0
    recovered: int = 0
    done: int = 0  # faults injected


def run(gpus: int = 10_000, faults: int = 10, timeout: float = 120.0) -> dict[str, Any]:
    """Fill the fleet half with gangs and instances, then hit one gang after another with an
    Xid 79 and measure its recovery (see the module's docstring)."""
    import sqlalchemy as sa

    started = time.perf_counter()
    # The provider's default boot time (not the 0.2 s other benchmarks use).
    env = ScratchDeployment(1, concurrency=2, env={"RACKPLANE_SIM_BOOT_SECONDS": "3"})
    try:
        seed_fleet(env, gpus)
        key = _tenant_key(env)
        op = platform_key(env)
        url = env.start(api_processes=1)
        engine = sa.create_engine(env.env["DATABASE_URL"])
        tenant = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        ops = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {op}"}, timeout=60)
        running, fillers = _fill(tenant, gpus, faults)
        tally = _Tally()
        for wid in running[:faults]:
            _fault(tenant, ops, engine, wid, timeout, tally)
        doubles = _double_allocations(engine)
        engine.dispose()
        return {
            "gpus": gpus,
            "gangs": len(running),
            "fillers": fillers,
            "faults": tally.done,
            "recovered": tally.recovered,
            "fault_to_requeued_p50_s": round(pct(tally.to_requeued, 0.5), 3),
            "fault_to_requeued_p99_s": round(pct(tally.to_requeued, 0.99), 3),
            "fault_to_running_p50_s": round(pct(tally.to_running, 0.5), 3),
            "fault_to_running_p99_s": round(pct(tally.to_running, 0.99), 3),
            "lost_work_gpu_s": round(tally.lost, 1),
            "lost_work_expected_gpu_s": round(tally.expected, 1),
            "lost_work_gpu_s_max_error": round(max(tally.lost_err, default=float("nan")), 3),
            "usage_billed_after_fault": tally.billed_after,
            "double_allocations": doubles,
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        env.close()


def _state(tenant: httpx.Client, wid: str) -> dict:
    """The workload as the tenant sees it."""
    return tenant.get(f"/v1/workloads/{wid}").json()


def _fill(tenant: httpx.Client, gpus: int, faults: int) -> tuple[list[str], int]:
    """Half the fleet: 8x8 gangs (at least one per fault) and 8-GPU instances; wait for the
    gangs to run and checkpoint each. The gangs running, and the instances submitted."""
    half = gpus // 2
    gangs = max(faults, half // 2 // 64)
    fillers = max(0, (half - gangs * 64) // 8)
    ids = []
    for _ in range(gangs):
        r = tenant.post("/v1/workloads", json=GANG)
        r.raise_for_status()
        ids.append(r.json()["id"])
    for _ in range(fillers):
        tenant.post("/v1/workloads", json={"kind": "instance", "gpus": 8}).raise_for_status()
    deadline = time.time() + 600
    while time.time() < deadline and not all(_state(tenant, w)["state"] == "running" for w in ids):
        time.sleep(1.0)
    running = [w for w in ids if _state(tenant, w)["state"] == "running"]
    for wid in running:
        tenant.post(f"/v1/workloads/{wid}/checkpoints", json={"size_bytes": 1 << 30})
    time.sleep(2.0)
    return running, fillers


def _fault(
    tenant: httpx.Client, ops: httpx.Client, engine, wid: str, timeout: float, tally: _Tally
) -> None:
    """An Xid 79 on one GPU of gang `wid`; wait for it to run again and tally the figures."""
    w = _state(tenant, wid)
    if w["state"] != "running":
        return
    p = w["placement"][tally.done % len(w["placement"])]
    host, gpu = p["node"], p["gpu_indices"][3 % len(p["gpu_indices"])]
    ckpt = _at(w["last_checkpoint_at"])
    fault = time.time()
    r = ops.post(
        "/v1/admin/telemetry",
        content=_xid_text(host, gpu, 79, int(fault * 1000)),
        headers={"Content-Type": "text/plain; version=0.0.4"},
    )
    r.raise_for_status()
    tally.done += 1
    end = time.time() + timeout
    back = None
    while time.time() < end:
        x = _state(tenant, wid)
        if x["interruptions"] >= 1 and x["state"] == "running":
            back = x
            break
        time.sleep(0.2)
    events = tenant.get(f"/v1/workloads/{wid}/events").json()["items"]
    tr = [e for e in events if e["kind"] == "transition"]
    i = next((k for k, e in enumerate(tr) if e["to_state"] == "preempted"), None)
    if i is None:
        return
    fault_at = _at(tr[i]["details"]["fault_at"])
    queued = next(e for e in tr[i:] if e["to_state"] == "queued")
    tally.to_requeued.append(_at(queued["at"]) - fault)
    if back is not None:
        run_again = next(e for e in tr[i:] if e["to_state"] == "running")
        tally.to_running.append(_at(run_again["at"]) - fault)
        tally.recovered += 1
        tally.lost += back["lost_work_gpu_s"]
        tally.expected += 64 * (fault_at - ckpt)
        tally.lost_err.append(abs(back["lost_work_gpu_s"] - 64 * (fault_at - ckpt)))
    back_at = _at(tr[-1]["at"]) if back is not None else None
    tally.billed_after += _billed_after(engine, wid, fault_at, back_at)


def _billed_after(engine, wid: str, fault_at: float, back_at: float | None) -> int:
    """Usage stops of the gang recorded between the fault and its run again (now, when it
    did not come back)."""
    import sqlalchemy as sa

    with engine.connect() as c:
        return int(
            c.execute(
                sa.text(
                    "SELECT count(*) FROM usage_events u WHERE u.workload_id = :w "
                    "AND u.occurred_at > :f AND u.occurred_at < :r AND u.kind = 'stop'"
                ),
                {
                    "w": wid,
                    "f": datetime.fromtimestamp(fault_at, UTC),
                    "r": datetime.fromtimestamp(
                        back_at if back_at is not None else time.time(), UTC
                    ),
                },
            ).scalar()
            or 0
        )


def _double_allocations(engine) -> int:
    """Whole-GPU allocations whose lifetimes overlap on one GPU, over the whole run."""
    import sqlalchemy as sa

    with engine.connect() as c:
        return int(
            c.execute(
                sa.text(
                    "SELECT count(*) FROM allocations a JOIN allocations b "
                    "ON a.node_id = b.node_id AND a.id < b.id AND a.milli = 1000 "
                    "AND b.milli = 1000 AND a.gpu_indices::jsonb ?| "
                    "array(SELECT jsonb_array_elements_text(b.gpu_indices::jsonb)) "
                    "AND a.created_at < coalesce(b.released_at, 'infinity') "
                    "AND b.created_at < coalesce(a.released_at, 'infinity')"
                )
            ).scalar()
        )


def _tenant_key(env: ScratchDeployment) -> str:
    return make_key(
        env,
        "t = create_tenant(s, name='Bench', slug='bench', contact_email='b@example.com',"
        " status='active', isolation_policy=None)\n"
        "    print(create_key(s, tenant_id=t.id, name='bench', scopes=['read','write']).key)\n",
    )
