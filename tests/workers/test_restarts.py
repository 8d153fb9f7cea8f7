"""Restart policies (issue 45 item 3): which causes restart a workload, which count against
its limit, and the back-off between counted restarts. The rule itself here; the paths that
requeue (an agent's reports, faults, preemptions) in tests/agents/test_runs.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.models.workloads import Workload
from app.workloads.restarts import decide, policy_of
from app.workloads.schemas import RestartPolicy


def _w(policy: dict | None = None, counts: dict | None = None) -> Workload:
    return Workload(restart_policy=policy, restart_counts=counts or {})


def test_the_default_never_loops_without_bound():
    # Its own failure ends it.
    assert not decide(_w(), "failure").restart
    # Infrastructure faults: ten restarts, the first at once, then 10 s doubling to 300 s.
    delays = []
    counts: dict = {}
    for _ in range(10):
        v = decide(_w(None, counts), "infrastructure")
        assert v.restart, v
        delays.append(v.delay_s)
        counts = {"infrastructure": counts.get("infrastructure", 0) + 1}
    assert delays == [0, 10, 20, 40, 80, 160, 300, 300, 300, 300]
    v = decide(_w(None, counts), "infrastructure")
    assert not v.restart and v.details["why"] == "restart_limit_reached"
    assert v.words == "restart limit reached: 10 of 10 restarts spent (infrastructure 10)"
    # Preemptions restart it without counting, even once the limit is spent.
    v = decide(_w(None, counts), "preemption")
    assert v.restart and v.delay_s == 0 and "do not count" in v.words


def test_failures_restart_when_asked_and_share_the_limit():
    policy = RestartPolicy(on=["failure", "infrastructure"], max_restarts=2, backoff_s=1)
    p = policy.model_dump()
    assert decide(_w(p), "failure").words == "restart 1 of 2 (failure)"
    v = decide(_w(p, {"infrastructure": 1}), "failure")
    assert v.restart and v.delay_s == 1 and v.words == "restart 2 of 2 (failure), in 1 s"
    assert not decide(_w(p, {"infrastructure": 1, "failure": 1}), "failure").restart
    # Not restarted after a preemption: it fails, saying so.
    v = decide(_w(p), "preemption")
    assert not v.restart and v.details["why"] == "cause_not_restarted"
    assert v.words == "its restart policy does not restart it after a preemption"


@pytest.mark.parametrize(
    "bad",
    [
        {"on": ["failure", "failure"]},
        {"on": ["crash"]},
        {"max_restarts": -1},
        {"max_restarts": 1001},
        {"backoff_s": 60, "backoff_max_s": 10},
        {"on": ["failure"], "counts": []},  # would restart its own failures forever
        {"on": ["infrastructure", "preemption"], "counts": ["failure"]},
    ],
)
def test_a_policy_that_cannot_be_is_refused(bad):
    with pytest.raises(ValidationError):
        RestartPolicy(**bad)


def test_a_stored_policy_that_restarted_without_limit_now_counts():
    w = Workload(restart_policy={"on": ["failure", "preemption"], "counts": [], "max_restarts": 2})
    got = policy_of(w)
    assert got.counts == ["failure"] and got.max_restarts == 2
