"""The agent's fixtures: its state directory, and whatever its runs left behind killed.

Its tests run real processes, with no server and no database (each module is marked
`no_db`)."""

from __future__ import annotations

import pytest

from tests.fixtures.agent import kill_leftovers


@pytest.fixture
def state_dir(tmp_path):
    """An agent state directory; whatever its runs left running is killed afterwards."""
    path = tmp_path / "state"
    yield path
    kill_leftovers(path)
