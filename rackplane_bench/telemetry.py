"""`rackplane bench telemetry`: dcgm-exporter text for N GPUs pushed through the real API (one
uvicorn process) into PostgreSQL.

The fleet's agents are simulated by the benchmark: each GPU reports ten fields per round, a
round is 30 s of the agents' clocks (the samples carry timestamps, as dcgm-exporter's text may),
and rounds are pushed as fast as the API takes them. Pushes are per rack (32 nodes: what one
rack's relay would send); `--batch-nodes` changes that. The first round is a warm-up (the API
reads each GPU's state once); the rounds after it are measured:
- samples_per_s: samples accepted per second of wall time;
- api_cpu_ms_per_1k_samples: the API process's CPU (user + system) per 1000 samples;
- db_writes_per_1k_samples: rows PostgreSQL inserted, updated or deleted (its own statistics,
  all tables) per 1000 samples. Write cadence follows the samples' clocks, so this is what the
  fleet would write at its real pace.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from rackplane_bench.deploy import ROOT, ScratchDeployment, cpu_seconds

FIELDS = (
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
)
NODE_GPUS = 8
RACK_NODES = 32
ROUND_S = 30


def fleet_document(gpus: int) -> str:
    nodes = -(-gpus // NODE_GPUS)
    racks = []
    for r in range(-(-nodes // RACK_NODES)):
        names = ", ".join(
            f"{{name: t-{n:06d}}}" for n in range(r * RACK_NODES, min(nodes, (r + 1) * RACK_NODES))
        )
        racks.append(
            f"      - name: rack-{r:04d}\n        kind: hgx\n        gpu_model: H100-80GB\n"
            f"        nodes: [{names}]\n"
        )
    return "regions:\n  - name: r1\n    racks:\n" + "".join(racks)


def exposition(nodes: list[int], ts_ms: int, rng: random.Random) -> bytes:
    """dcgm-exporter's text for these nodes' GPUs at one instant (its full label set)."""
    lines = []
    for field, kind, help_ in FIELDS:
        lines.append(f"# HELP {field} {help_}\n# TYPE {field} {kind}")
        for n in nodes:
            host = f"t-{n:06d}"
            for g in range(NODE_GPUS):
                value = {
                    "DCGM_FI_DEV_GPU_TEMP": 40 + rng.randrange(30),
                    "DCGM_FI_DEV_MEMORY_TEMP": 45 + rng.randrange(30),
                    "DCGM_FI_DEV_POWER_USAGE": round(300 + rng.random() * 400, 3),
                    "DCGM_FI_DEV_SM_CLOCK": 1980 - rng.randrange(60),
                    "DCGM_FI_DEV_GPU_UTIL": rng.randrange(100),
                    "DCGM_FI_DEV_FB_USED": rng.randrange(81920),
                    "DCGM_FI_DEV_XID_ERRORS": 0,
                    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0,
                    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0,
                    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
                }[field]
                uuid = f"GPU-{n:08x}-{g:04x}-4000-8000-{n * NODE_GPUS + g:012x}"
                lines.append(
                    f'{field}{{gpu="{g}",UUID="{uuid}",pci_bus_id="00000000:{0x18 + g:02X}:00.0",'
                    f'device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="{host}",'
                    f'DCGM_FI_DRIVER_VERSION="550.54.15"}} {value} {ts_ms}'
                )
    return ("\n".join(lines) + "\n").encode()


def make_key(env: ScratchDeployment, body: str) -> str:
    """An API key made in a child process on the scratch database (`body` prints it)."""
    code = (
        "import app.models\n"
        "from app.core.db import session_scope\n"
        "from app.keys.service import create_key\n"
        "from app.tenants.service import create_tenant\n"
        "with session_scope() as s:\n    " + body
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env.env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def platform_key(env: ScratchDeployment) -> str:
    return make_key(
        env, "print(create_key(s, tenant_id=None, name='agents', scopes=['platform']).key)\n"
    )


def seed_fleet(env: ScratchDeployment, gpus: int) -> None:
    code = (
        "import sys\n"
        "import app.models\n"
        "from app.core.db import session_scope\n"
        "from app.fleet import document\n"
        "from app.fleet.service import apply_document\n"
        "with session_scope() as s:\n"
        "    apply_document(s, document.load(sys.stdin.read()))\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env.env,
        input=fleet_document(gpus),
        text=True,
        capture_output=True,
        check=True,
    )


def _db_writes(env: ScratchDeployment) -> int:
    import sqlalchemy as sa

    engine = sa.create_engine(env.env["DATABASE_URL"])
    try:
        with engine.connect() as c:
            return int(
                c.execute(
                    sa.text(
                        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) "
                        "FROM pg_stat_user_tables"
                    )
                ).scalar()
            )
    finally:
        engine.dispose()


def run(gpus: int, rounds: int = 3, batch_nodes: int = RACK_NODES, clients: int = 4) -> dict:
    started = time.perf_counter()
    env = ScratchDeployment(0)
    try:
        seed_fleet(env, gpus)
        key = platform_key(env)
        url = env.start(api_processes=1)
        api = [env.procs[0].pid]
        nodes = -(-gpus // NODE_GPUS)
        rng = random.Random(20261125)
        t0 = int(time.time() * 1000) - (rounds + 1) * ROUND_S * 1000
        per_round = [
            [
                exposition(
                    list(range(i, min(nodes, i + batch_nodes))), t0 + r * ROUND_S * 1000, rng
                )
                for i in range(0, nodes, batch_nodes)
            ]
            for r in range(rounds + 1)
        ]
        samples_per_round = nodes * NODE_GPUS * len(FIELDS)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "text/plain; version=0.0.4"}

        async def push_round(bodies: list[bytes]) -> int:
            accepted = 0
            queue = list(bodies)
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:

                async def one() -> None:
                    nonlocal accepted
                    while queue:
                        body = queue.pop()
                        r = await c.post("/v1/admin/telemetry", content=body)
                        r.raise_for_status()
                        accepted += r.json()["accepted"]

                await asyncio.gather(*(one() for _ in range(clients)))
            return accepted

        asyncio.run(push_round(per_round[0]))  # warm-up: each GPU's state read once
        time.sleep(1.5)  # PostgreSQL's statistics catch up
        writes0, cpu0, wall0 = _db_writes(env), cpu_seconds(api), time.perf_counter()
        accepted = 0
        for r in range(1, rounds + 1):
            accepted += asyncio.run(push_round(per_round[r]))
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds(api) - cpu0
        time.sleep(1.5)
        writes = _db_writes(env) - writes0
        assert accepted == samples_per_round * rounds, (accepted, samples_per_round * rounds)
        return {
            "gpus": nodes * NODE_GPUS,
            "fields": len(FIELDS),
            "rounds": rounds,
            "batch_nodes": batch_nodes,
            "samples": accepted,
            "samples_per_s": round(accepted / wall),
            "api_cpu_ms_per_1k_samples": round(cpu * 1000 / (accepted / 1000), 2),
            "db_writes_per_1k_samples": round(writes / (accepted / 1000), 2),
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        env.close()


def median_run(runs: int, **kwargs: Any) -> dict:
    results = [run(**kwargs) for _ in range(runs)]
    out = dict(results[0])
    for k in ("samples_per_s", "api_cpu_ms_per_1k_samples", "db_writes_per_1k_samples"):
        out[k] = statistics.median(r[k] for r in results)
    out["runs"] = runs
    out["samples_per_s_each"] = [r["samples_per_s"] for r in results]
    return out
