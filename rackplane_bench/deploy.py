"""A scratch deployment for benchmarks: a scratch PostgreSQL database and Redis key prefix, a
uvicorn API and Celery workers over them, and what the benchmarks measure them with (CPU seconds
of a process tree, percentiles, medians of runs)."""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
API_PROCESSES = 2  # uvicorn worker processes: one per core here


def region_names(regions: int) -> list[str]:
    return [f"r{i + 1}" for i in range(regions)]


def fleet_yaml(nodes_per_region: int, regions: int = 2) -> str:
    """Regions r1..rN of 8-GPU H100 nodes, sized so capacity never runs out during the load:
    the benchmark measures the control plane, not a full fleet."""
    out = []
    for r in region_names(regions):
        nodes = ", ".join(f"{{name: {r}-n{i}}}" for i in range(nodes_per_region))
        out.append(
            f"  - name: {r}\n    racks:\n      - name: {r}-hgx\n        kind: hgx\n"
            f"        gpu_model: H100-80GB\n        nodes: [{nodes}]\n"
        )
    return "regions:\n" + "".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_command(port: int, processes: int = 1, host: str = "127.0.0.1") -> list[str]:
    """The command line of a uvicorn API on `host`:`port`."""
    argv = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", host, "--port", str(port)]
    argv += ["--log-level", "warning"]
    return argv + (["--workers", str(processes)] if processes > 1 else [])


def pct(xs: list[float], q: float) -> float:
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

    def seed(self, nodes_per_region: int, regions: int = 2) -> tuple[str, str]:
        """The fleet (`regions` regions), a tenant and its key (in a child process, on the
        scratch database)."""
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
            input=fleet_yaml(nodes_per_region, regions),
            capture_output=True,
            text=True,
            check=True,
        )
        import json

        return json.loads(out.stdout.strip().splitlines()[-1])["key"], self.env["DATABASE_URL"]

    def start(self, api_processes: int = API_PROCESSES, host: str = "127.0.0.1") -> str:
        from workers.settings import worker_command

        port = free_port()
        url = f"http://{host}:{port}"
        self.env["RACKPLANE_PUBLIC_API_URL"] = url  # what runs report their checkpoints to
        log = open(Path(self.dir) / "api.log", "wb")
        self.procs.append(
            subprocess.Popen(
                api_command(port, api_processes, host),
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


def cpu_seconds(pids: list[int]) -> float:
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


def postgres_pids() -> list[int]:
    """This machine's PostgreSQL server processes (CPU per request includes the server's)."""
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith("postgres")
    ]


def redis_pids() -> list[int]:
    """This machine's Redis server processes."""
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith("redis-server")
    ]


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
