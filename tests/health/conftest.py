"""The health loop's tables and decisions: no database."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def clean_db():
    """Override the service tests' database cleaner: nothing here touches a database."""
    yield
