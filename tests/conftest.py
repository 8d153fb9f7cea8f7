"""Test harness: a fresh throw-away PostgreSQL database and a private Redis key prefix per run.

The environment is set in `pytest_configure`, before any application module reads settings.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
ADMIN_DB_URL = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RUN_ID = f"{os.getpid()}_{secrets.token_hex(3)}"
TEST_DB = f"rackplane_test_{RUN_ID}"


def _admin_exec(sql: str) -> None:
    import psycopg

    with psycopg.connect(ADMIN_DB_URL, autocommit=True) as conn:
        conn.execute(sql)


def db_url(name: str) -> str:
    base, _, _ = ADMIN_DB_URL.rpartition("/")
    return f"{base}/{name}"


def create_database(name: str) -> str:
    _admin_exec(f'CREATE DATABASE "{name}"')
    return db_url(name)


def drop_database(name: str) -> None:
    _admin_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_created = False


def pytest_configure(config: pytest.Config) -> None:
    data_dir = tempfile.mkdtemp(prefix="rackplane-test-")
    os.environ.update(
        {
            # Never the checkout's `.env` (the README suggests one for settings): the tests
            # set what they need, and its processes inherit this.
            "RACKPLANE_ENV_FILE": "",
            "DATABASE_URL": db_url(TEST_DB),
            "REDIS_URL": REDIS_URL,
            "RACKPLANE_BROKER_PREFIX": f"rptest-{RUN_ID}:",
            "RACKPLANE_DATA_DIR": data_dir,
            "RACKPLANE_LOG_JSON": "true",
            "RACKPLANE_LOG_LEVEL": "WARNING",
            "RACKPLANE_SEED_DEMO": "false",
            # Tests drive MIG re-layouts themselves (miglayout.advance), never by the beat.
            "RACKPLANE_MIG_RELAYOUT": "false",
            # Test fleets name no pools: `process` runs on every agent's node (its own uid per
            # run); tests/test_node_wall.py checks the pool rule with its own setting.
            "RACKPLANE_PROCESS_POOLS": "*",
            # PostgreSQL refuses to start without the server secrets.
            "RACKPLANE_KEY_PEPPER": f"test-pepper-{RUN_ID}-{secrets.token_hex(8)}",
            "RACKPLANE_SECRET_KEY": f"test-secret-{RUN_ID}-{secrets.token_hex(8)}",
            # Limits far above what any test sends; tests/test_ratelimit.py sets its own.
            "RACKPLANE_RATE_LIMITS": (
                "read=100000/s,write=100000/s,expensive=100000/s,signup=100000/s,signin=100000/s"
            ),
            # Quick machines and short grace periods, so lifecycles finish within a test.
            "RACKPLANE_SIM_BOOT_SECONDS": "0.3",
            "RACKPLANE_PREEMPTION_GRACE": "1",
            "RACKPLANE_PLACEMENT_TICK": "1",
            "RACKPLANE_BUDGET_EVAL_SECONDS": "1",
            # Repairs in seconds, not minutes.
            "RACKPLANE_SIM_RESET_SECONDS": "0.5",
            "RACKPLANE_SIM_REBOOT_SECONDS": "2",
            "RACKPLANE_VALIDATE_SECONDS": "0.5",
            "RACKPLANE_HEALTH_SWEEP": "1",
            "RACKPLANE_CHAOS_ENABLED": "true",
        }
    )


@pytest.fixture(scope="session")
def database():
    """The run's throw-away PostgreSQL database, created and migrated on first use (tests of
    the pure placement core never ask for it)."""
    global _created
    create_database(TEST_DB)
    _created = True
    from app.cli import migrate_db

    migrate_db()
    return db_url(TEST_DB)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _created:
        from app.core.db import get_engine

        get_engine().dispose()
        drop_database(TEST_DB)
    try:
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(match=f"rptest-{RUN_ID}:*", count=1000))
        if keys:
            r.delete(*keys)
    except Exception:
        pass


TABLES = [
    "workload_logs",
    "workload_log_sizes",
    "agent_nodes",
    "audit_log",
    "chaos_injections",
    "sim_provider_faults",
    "chaos_experiments",
    "health_events",
    "health_incidents",
    "health_repairs",
    "node_heartbeats",
    "mig_relayouts",
    "upgrade_nodes",
    "upgrades",
    "burn_ins",
    "gpu_telemetry",
    "idle_iron",
    "idle_time",
    "placement_cycle_stats",
    "budget_alerts",
    "budgets",
    "commitments",
    "meter_exports",
    "billing_adjustments",
    "meter_export_cursor",
    "prices",
    "usage_events",
    "mig_claims",
    "gpu_usage",
    "allocations",
    "workload_events",
    "workloads",
    "tenant_quotas",
    "gpus",
    "node_join_tokens",
    "node_credentials",
    "nodes",
    "software_stacks",
    "racks",
    "regions",
    "fleet_imports",
    "browser_sessions",
    "api_keys",
    "tenants",
    "idempotency_records",
    "outbox",
]


@pytest.fixture(autouse=True)
def clean_db(database):
    """Every test starts from empty tables."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from app.core.db import get_engine

    # A worker process may still be finishing an earlier test's task: a deadlock with it just
    # means truncating again.
    for attempt in range(30):
        try:
            with get_engine().begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '2s'"))
                conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
            break
        except OperationalError:
            if attempt == 29:
                raise
            time.sleep(0.3)
    from app.health import telemetry

    telemetry._STATE.clear()  # this process's view of the fleet's telemetry
    yield


@pytest.fixture(scope="session")
def app():
    from app.main import create_app

    return create_app()


@pytest.fixture
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def session():
    from app.core.db import get_sessionmaker

    with get_sessionmaker()() as s:
        yield s


# --- small builders -------------------------------------------------------------------------


class World:
    """Builders for tenants, keys and fleet rows, committed so the API sees them."""

    def tenant(self, slug: str, *, status: str = "active", policy: list[str] | None = None):
        from app.core.db import session_scope
        from app.tenants.service import create_tenant

        with session_scope() as s:
            return create_tenant(
                s,
                name=slug.title(),
                slug=slug,
                contact_email=f"{slug}@example.com",
                status=status,
                isolation_policy=policy,
            )

    def key(self, tenant=None, scopes=("read", "write", "admin"), name: str = "test") -> str:
        from app.core.db import session_scope
        from app.keys.service import create_key

        with session_scope() as s:
            if tenant is None:
                return create_key(s, tenant_id=None, name=name, scopes=["platform"]).key
            return create_key(s, tenant_id=tenant.id, name=name, scopes=list(scopes)).key

    def fleet(self, text: str) -> dict:
        from app.core.db import session_scope
        from app.fleet import document
        from app.fleet.service import apply_document

        with session_scope() as s:
            return apply_document(s, document.load(text))


@pytest.fixture
def world() -> World:
    return World()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# One cordoned H100 node: workloads submitted on it stay queued (no worker places them).
CORDONED_H100 = """
regions:
  - name: r1
    racks:
      - name: hgx-h100
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: h100-1, state: cordoned}]
"""

SMALL_FLEET = """
regions:
  - name: r1
    racks:
      - {name: nvl-1, kind: nvl72, block: spine-1}
      - name: hgx-1
        kind: hgx
        gpu_model: H100-80GB
        nodes:
          - {name: h100-1, mig_gpus: [7]}
          - {name: h100-2, state: cordoned}
"""


# --- a real API process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(database):
    """A real uvicorn API process on the test database and Redis; its base URL."""
    from rackplane_bench.deploy import api_command, free_port

    port = free_port()
    log = open(os.path.join(os.environ["RACKPLANE_DATA_DIR"], "api.log"), "wb")
    proc = subprocess.Popen(
        api_command(port),
        cwd=ROOT,
        env=dict(os.environ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


# --- a real Celery worker process -------------------------------------------------------------


@pytest.fixture(scope="session")
def celery_worker_process(database):
    """A real `celery worker` process on the test database and Redis (with beat)."""
    from workers.settings import worker_command

    log = Path(os.environ["RACKPLANE_DATA_DIR"]) / "worker.log"
    env = {**os.environ, "RACKPLANE_LOG_LEVEL": "INFO"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            worker_command(f"test-{RUN_ID}@%h", beat=True),
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its pool and beat stop with it
        )
    deadline = time.time() + 60
    while time.time() < deadline:
        if b"ready" in log.read_bytes():
            break
        if proc.poll() is not None:
            raise RuntimeError("celery worker died:\n" + log.read_text()[-4000:])
        time.sleep(0.3)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("celery worker did not become ready:\n" + log.read_text()[-4000:])
    yield proc
    from app.core.processes import stop_groups

    stop_groups([proc])


def wait_until(fn, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
