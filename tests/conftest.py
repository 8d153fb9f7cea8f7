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

from tests.fixtures.harness import (
    REDIS_URL,
    ROOT,
    RUN_ID,
    TABLES,
    TEST_DB,
    create_database,
    db_url,
    drop_database,
)
from tests.fixtures.world import World, wait_until

# Fixtures defined in tests/fixtures/ that tests ask for by name.
pytest_plugins = ["tests.fixtures.browser"]

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
            # run); tests/agents/test_node_wall.py checks the pool rule with its own setting.
            "RACKPLANE_PROCESS_POOLS": "*",
            # PostgreSQL refuses to start without the server secrets.
            "RACKPLANE_KEY_PEPPER": f"test-pepper-{RUN_ID}-{secrets.token_hex(8)}",
            "RACKPLANE_SECRET_KEY": f"test-secret-{RUN_ID}-{secrets.token_hex(8)}",
            # Limits far above what any test sends; tests/ratelimit/test_limits.py sets its own.
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


@pytest.fixture(autouse=True)
def clean_db(request):
    """Every test starts from empty tables. Tests marked `no_db` (the pure placement core, the
    agent, the health loop's decisions) never touch the database, nor create it."""
    if request.node.get_closest_marker("no_db"):
        yield
        return
    request.getfixturevalue("database")
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


@pytest.fixture
def world() -> World:
    return World()


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
