"""Operator settings of the queueing core reach the scheduler the placement worker builds."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app.core.config import get_settings
from app.scheduling.world import Loaded
from tests.fixtures.snapshots import node, snap


@pytest.fixture
def settings_env(monkeypatch):
    get_settings.cache_clear()
    yield monkeypatch
    monkeypatch.delenv("RACKPLANE_FAIR_SHARE_CAP", raising=False)
    monkeypatch.delenv("RACKPLANE_PREEMPTION_GRACE", raising=False)
    get_settings.cache_clear()


def _scheduler():
    return Loaded(SimpleNamespace(snap=snap(node("n1"))), {}, [], {}).scheduler()


def test_fair_share_cap_and_grace_come_from_the_environment(settings_env):
    assert _scheduler().config.share_cap is None  # work-conserving unless set
    settings_env.setenv("RACKPLANE_FAIR_SHARE_CAP", "1.25")
    settings_env.setenv("RACKPLANE_PREEMPTION_GRACE", "30")
    get_settings.cache_clear()
    config = _scheduler().config
    assert (config.share_cap, config.grace_period) == (1.25, 30.0)


def test_a_fair_share_cap_below_one_is_refused(settings_env):
    settings_env.setenv("RACKPLANE_FAIR_SHARE_CAP", "0.5")
    with pytest.raises(ValidationError, match="RACKPLANE_FAIR_SHARE_CAP"):
        get_settings()
