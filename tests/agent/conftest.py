"""The agent's tests: real processes, no server and no database.

The repository's conftest makes every test ask for a PostgreSQL database (its autouse
`clean_db`); these tests override that fixture with one that needs nothing.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from rackplane_agent.runusers import CLAIMS_DIR


@pytest.fixture(autouse=True)
def clean_db():
    """Overrides tests/conftest.py's: the agent's tests never touch the database."""
    yield


def _kill_leftovers(root: Path) -> None:
    for run_json in root.rglob("run.json"):
        try:
            data = json.loads(run_json.read_text())
        except (OSError, ValueError):
            continue
        pid = data.get("pid")
        if not pid:
            continue
        try:
            proc = psutil.Process(pid)
            if data.get("create_time") and abs(proc.create_time() - data["create_time"]) > 0.05:
                continue
            os.killpg(pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    # The uids its runs held on this host go back (an agent gives them back as it forgets).
    if CLAIMS_DIR.is_dir():
        for claim in CLAIMS_DIR.iterdir():
            try:
                if claim.read_text() == str(root.absolute()):
                    claim.unlink()
            except OSError:
                pass


@pytest.fixture
def state_dir(tmp_path):
    """An agent state directory; whatever its runs left running is killed afterwards."""
    path = tmp_path / "state"
    yield path
    _kill_leftovers(path)
