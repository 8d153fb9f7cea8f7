"""`rackplane bench lifecycle`: submit-to-placed latency through the real path.

A scratch PostgreSQL database and Redis key prefix, a uvicorn API (two processes), N Celery
worker processes (the first also runs beat) of `concurrency` pool processes each, a fleet of two
regions (two partitions), and an open-loop load: submissions at a fixed rate, alternating
regions, and (with churn, the default) each one terminated through the API a second after it
runs, so the fleet turns over instead of filling. Submit-to-placed is the time from sending the
POST to the workload's `placing` event (same machine, same clock).
"""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_PROCESSES = 2  # uvicorn worker processes: one per core here


def _fleet(nodes_per_region: int) -> str:
    """Two regions of 8-GPU H100 nodes, sized so capacity never runs out during the load:
    the benchmark measures the control plane, not a full fleet."""
    regions = []
    for r in ("r1", "r2"):
        nodes = ", ".join(f"{{name: {r}-n{i}}}" for i in range(nodes_per_region))
        regions.append(
            f"  - name: {r}\n    racks:\n      - name: {r}-hgx\n        kind: hgx\n"
            f"        gpu_model: H100-80GB\n        nodes: [{nodes}]\n"
        )
    return "regions:\n" + "".join(regions)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_command(port: int, processes: int = 1) -> list[str]:
    """The command line of a uvicorn API on 127.0.0.1:`port`."""
    argv = [sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)]
    argv += ["--log-level", "warning"]
    return argv + (["--workers", str(processes)] if processes > 1 else [])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class ScratchDeployment:
    """A scratch database and broker prefix, with the processes that use them."""

    def __init__(
        self,
        workers: int,
        redis_url: str | None = None,
        env: dict[str, str] | None = None,
        concurrency: int = 1,
    ):
        import sqlalchemy as sa

        base = os.environ.get(
            "DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        )
        if base.startswith("postgresql://"):
            base = "postgresql+psycopg://" + base[len("postgresql://") :]
        self.name = f"rackplane_bench_{secrets.token_hex(4)}"
        self.admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{self.name}"'))
        url = sa.engine.make_url(base).set(database=self.name)
        self.dir = tempfile.mkdtemp(prefix="rackplane-bench-")
        self.prefix = f"bench-{self.name}:"
        self.env = {
            **os.environ,
            "DATABASE_URL": url.render_as_string(hide_password=False),
            "REDIS_URL": redis_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
            "RACKPLANE_BROKER_PREFIX": self.prefix,
            "RACKPLANE_DATA_DIR": self.dir,
            "RACKPLANE_SEED_DEMO": "false",
            "RACKPLANE_SIM_BOOT_SECONDS": "0.2",
            "RACKPLANE_PLACEMENT_TICK": "1",
            "RACKPLANE_LOG_LEVEL": "INFO",
            "RACKPLANE_LOG_JSON": "true",
            # A scratch deployment on PostgreSQL needs its own server secrets (or the caller's).
            "RACKPLANE_KEY_PEPPER": os.environ.get("RACKPLANE_KEY_PEPPER")
            or secrets.token_urlsafe(32),
            "RACKPLANE_SECRET_KEY": os.environ.get("RACKPLANE_SECRET_KEY")
            or secrets.token_urlsafe(32),
            # The limiter runs (its cost is measured) but never refuses the load.
            "RACKPLANE_RATE_LIMITS": "read=1000000/s,write=1000000/s,expensive=1000000/s",
            **(env or {}),
        }
        self.procs: list[subprocess.Popen] = []
        self._run([sys.executable, "-m", "app.cli", "migrate"])
        self.workers = workers
        self.concurrency = concurrency

    def _run(self, argv: list[str]) -> None:
        subprocess.run(argv, cwd=ROOT, env=self.env, check=True, capture_output=True)

    def seed(self, nodes_per_region: int) -> tuple[str, str]:
        """The fleet, a tenant and its key (in a child process, on the scratch database)."""
        code = (
            "import json\n"
            "from app.core.db import session_scope\n"
            "from app.fleet import document\n"
            "from app.fleet.service import apply_document\n"
            "from app.tenants.service import create_tenant\n"
            "from app.keys.service import create_key\n"
            "import sys\n"
            "with session_scope() as s:\n"
            "    apply_document(s, document.load(sys.stdin.read()))\n"
            "    t = create_tenant(s, name='Bench', slug='bench', contact_email='b@example.com',"
            " status='active', isolation_policy=None)\n"
            "    k = create_key(s, tenant_id=t.id, name='bench', scopes=['read','write'])\n"
            "    print(json.dumps({'key': k.key}))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=self.env,
            input=_fleet(nodes_per_region),
            capture_output=True,
            text=True,
            check=True,
        )
        import json

        return json.loads(out.stdout.strip().splitlines()[-1])["key"], self.env["DATABASE_URL"]

    def start(self, api_processes: int = API_PROCESSES) -> str:
        from workers.settings import worker_command

        port = free_port()
        log = open(Path(self.dir) / "api.log", "wb")
        self.procs.append(
            subprocess.Popen(
                api_command(port, api_processes),
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        for i in range(self.workers):
            wlog = open(Path(self.dir) / f"worker{i}.log", "wb")
            argv = worker_command(f"w{i}@{self.name}", beat=i == 0, concurrency=self.concurrency)
            self.procs.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=self.env,
                    stdout=wlog,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its pool and beat stop with it
                )
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        logs = [Path(self.dir) / f"worker{i}.log" for i in range(self.workers)]
        while time.time() < deadline and not all(b"ready" in p.read_bytes() for p in logs):
            time.sleep(0.2)
        return url

    def cycles(self) -> int:
        return sum(
            (Path(self.dir) / f"worker{i}.log").read_bytes().count(b'"event": "placement_cycle"')
            for i in range(self.workers)
        )

    def close(self) -> None:
        import redis
        import sqlalchemy as sa

        from app.core.processes import stop_groups

        stop_groups(self.procs)
        r = redis.Redis.from_url(self.env["REDIS_URL"])
        for k in r.scan_iter(f"{self.prefix}*"):
            r.delete(k)
        with self.admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))


def run(
    workers: int,
    rate: float,
    duration: float,
    churn: bool = True,
    warmup: float = 5.0,
    concurrency: int = 1,
) -> dict[str, Any]:
    """`warmup` seconds of the same load come first and are left out of the figures: the
    target is a sustained rate, and the first requests pay for cold processes (connection
    pools filling, compiled-statement caches, the workers' first full read of each region)."""
    import sqlalchemy as sa

    started = time.perf_counter()
    env = ScratchDeployment(workers, concurrency=concurrency)
    try:
        warm = int(rate * warmup)
        n = warm + int(rate * duration)
        key, db = env.seed(nodes_per_region=max(8, -(-n // 16) + 4))
        url = env.start()
        engine = sa.create_engine(db)
        headers = {"Authorization": f"Bearer {key}"}
        sent: dict[str, float] = {}
        api_ms: list[float] = []
        errors = 0
        stop = threading.Event()
        client = httpx.Client(
            base_url=url, headers=headers, timeout=30, limits=httpx.Limits(max_connections=64)
        )

        async def load() -> None:
            """Open loop on one event loop: each submission leaves at its scheduled time,
            whatever the earlier ones are waiting for (threads cost the load generator a core
            this machine does not have). aiohttp, because httpx's async pool costs O(waiting)
            per request and ate a core at 100/s."""
            import asyncio

            import aiohttp

            nonlocal errors
            async with aiohttp.ClientSession(
                base_url=url,
                headers=headers,
                connector=aiohttp.TCPConnector(limit=256),
                timeout=aiohttp.ClientTimeout(total=60),
            ) as ac:

                async def one(i: int) -> None:
                    nonlocal errors
                    delay = t0 + i / rate - time.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    t = time.time()
                    body = {
                        "kind": "instance",
                        "gpus": 1,
                        "region": "r1" if i % 2 else "r2",
                        "max_runtime_s": 600,
                    }
                    try:
                        async with ac.post("/v1/workloads", json=body) as r:
                            status, out = r.status, await r.json(content_type=None)
                    except (aiohttp.ClientError, TimeoutError):
                        errors += i >= warm
                        return
                    if i < warm:  # warming up: not measured
                        return
                    api_ms.append((time.time() - t) * 1000)
                    if status == 201:
                        sent[out["id"]] = t
                    else:
                        errors += 1

                await asyncio.gather(*(one(i) for i in range(n)))

        def terminate_running() -> None:
            """Terminate what has run for a second, so the fleet keeps turning over."""
            while not stop.is_set():
                with engine.connect() as c:
                    rows = (
                        c.execute(
                            sa.text(
                                "SELECT id FROM workloads WHERE state = 'running' "
                                "AND started_at < now() - interval '1 second' LIMIT 100"
                            )
                        )
                        .scalars()
                        .all()
                    )
                for wid in rows:
                    try:
                        client.delete(f"/v1/workloads/{wid}")
                    except httpx.HTTPError:
                        return  # the API is shutting down
                stop.wait(0.3)

        churner = threading.Thread(target=terminate_running, daemon=True)
        if churn:
            churner.start()
        cycles0 = env.cycles()
        t0 = time.time() + 0.5
        import asyncio

        asyncio.run(load())
        load_s = time.time() - t0

        def placed() -> dict[str, float]:
            with engine.connect() as c:
                rows = c.execute(
                    sa.text(
                        "SELECT workload_id, min(at) FROM workload_events "
                        "WHERE to_state = 'placing' GROUP BY workload_id"
                    )
                ).all()
            return {
                str(w): at.replace(tzinfo=UTC).timestamp() if at.tzinfo is None else at.timestamp()
                for w, at in rows
            }

        deadline = time.time() + 60
        got = placed()
        while time.time() < deadline and len([w for w in sent if w in got]) < len(sent):
            time.sleep(0.5)
            got = placed()
        cycles = env.cycles() - cycles0
        stop.set()
        if churn:
            churner.join(timeout=5)
        lat = [(got[w] - s) * 1000 for w, s in sent.items() if w in got]
        first = min(sent.values(), default=t0)
        last = max((got[w] for w in sent if w in got), default=first)
        return {
            "workers": workers,
            "concurrency": concurrency,
            "partitions": 2,
            "rate": rate,
            "churn": churn,
            "duration_s": duration,
            "warmup_s": warmup,
            "submitted": len(sent),
            "rejected": errors,
            "placed": len(lat),
            "p50_submit_to_placed_ms": round(_pct(lat, 0.5), 1),
            "p99_submit_to_placed_ms": round(_pct(lat, 0.99), 1),
            "max_submit_to_placed_ms": round(max(lat, default=float("nan")), 1),
            "p99_submit_api_ms": round(_pct(api_ms, 0.99), 1),
            "placements_per_s": round(len(lat) / max(last - first, 1e-9), 1),
            "offered_per_s": round(n / max(load_s, 1e-9), 1),
            "cycles_per_s": round(cycles / max(last - first, 1e-9), 1),
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        env.close()


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _postgres_pids() -> list[int]:
    """This machine's PostgreSQL server processes (CPU per request includes the server's)."""
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith("postgres")
    ]


def run_api(requests: int, warmup: int = 300) -> dict[str, Any]:
    """CPU per request of the API's hot routes, one at a time on one API process: POST, GET
    and DELETE of `/v1/workloads`. CPU (user + system, from the kernel's accounting) rather
    than wall time, so the figure says what each request costs the machine whatever else it
    runs; PostgreSQL's and the worker's CPU in the same interval are reported beside it (the
    worker's includes the placement cycles and provisioning each request causes)."""
    started = time.perf_counter()
    env = ScratchDeployment(1)
    try:
        key, _ = env.seed(nodes_per_region=max(8, -(-(requests + warmup) // 8) + 4))
        url = env.start(api_processes=1)
        api, workers = [env.procs[0].pid], [p.pid for p in env.procs[1:]]
        body = {"kind": "instance", "gpus": 1, "region": "r1", "max_runtime_s": 600}
        out: dict[str, Any] = {"requests": requests}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            for _ in range(warmup):
                c.post("/v1/workloads", json=body).raise_for_status()
            time.sleep(2)
            ids: list[str] = []
            calls = {
                "post": lambda i: c.post("/v1/workloads", json=body),
                "get": lambda i: c.get(f"/v1/workloads/{ids[i]}"),
                "delete": lambda i: c.delete(f"/v1/workloads/{ids[i]}"),
            }
            for route, call in calls.items():
                pg = _postgres_pids()
                a, p, w, t = _cpu_s(api), _cpu_s(pg), _cpu_s(workers), time.perf_counter()
                for i in range(requests):
                    r = call(i)
                    r.raise_for_status()
                    if route == "post":
                        ids.append(r.json()["id"])
                wall = time.perf_counter() - t
                time.sleep(1.5)  # the work the requests caused (cycles, provisioning) settles
                ms = 1000 / requests
                out[f"{route}_wall_ms"] = round(wall * ms, 2)
                out[f"{route}_api_cpu_ms"] = round((_cpu_s(api) - a) * ms, 2)
                out[f"{route}_pg_cpu_ms"] = round((_cpu_s(pg) - p) * ms, 2)
                out[f"{route}_worker_cpu_ms"] = round((_cpu_s(workers) - w) * ms, 2)
        out["seconds"] = round(time.perf_counter() - started, 1)
        return out
    finally:
        env.close()


def median_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [
        k for k, v in results[0].items() if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    out = dict(results[0])
    for k in keys:
        out[k] = round(statistics.median(r[k] for r in results), 1)
    out["runs"] = len(results)
    out["at"] = datetime.now(UTC).isoformat(timespec="seconds")
    return out
