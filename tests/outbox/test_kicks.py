"""Kicks against the real Redis broker: a burst of commits sends one message until the sweep
clears its key; rollbacks send nothing; and a kick lost on its way is covered by the placement
tick on a real worker."""

from __future__ import annotations

import os
import time

import pytest
import redis

from tests.fixtures.harness import REDIS_URL
from tests.fixtures.world import auth, wait_until


@pytest.fixture
def queue_len():
    r = redis.Redis.from_url(REDIS_URL)
    name = f"kicktest-{time.time_ns()}"
    prefix = os.environ["RACKPLANE_BROKER_PREFIX"]

    def length() -> int:
        return r.llen(f"{prefix}{name}")

    yield name, length
    r.delete(f"{prefix}{name}")


def _commit_kick(queue: str, key: str, rollback: bool = False) -> None:
    from app.core.db import session_scope
    from app.outbox import kicks

    try:
        with session_scope() as session:
            kicks.kick(session, "test.sweep", queue=queue, key=key, region=key)
            if rollback:
                raise RuntimeError("the change is abandoned")
    except RuntimeError:
        pass


def test_a_burst_of_commits_sends_one_kick_until_the_sweep_clears_it(database, queue_len):
    from app.outbox import kicks

    queue, length = queue_len
    a, b, c = (f"{queue}-{k}" for k in "abc")  # keys of this test only
    for _ in range(20):
        _commit_kick(queue, a)
    assert length() == 1  # the sweep asked for has not read the database yet
    _commit_kick(queue, b)
    assert length() == 2  # another key is another sweep
    _commit_kick(queue, c, rollback=True)
    assert length() == 2  # nothing committed, nothing to sweep
    kicks.clear("test.sweep", a)  # the sweep starts: later commits may be unseen by it
    _commit_kick(queue, a)
    _commit_kick(queue, a)
    assert length() == 3


def test_a_kick_key_that_outlives_its_message_expires(database, queue_len, monkeypatch):
    """The message of a kick can be lost after its key was set (a crash between the two): the
    key then mutes kicks only until its TTL ends."""
    from app.outbox import kicks

    monkeypatch.setattr(kicks, "TTL_MS", 300)
    queue, length = queue_len
    _commit_kick(queue, queue)
    _commit_kick(queue, queue)
    assert length() == 1
    time.sleep(0.4)
    _commit_kick(queue, queue)
    assert length() == 2


def test_work_whose_kick_was_lost_is_placed_by_the_tick(client, world, celery_worker_process):
    """A region's kick key already set (its message lost): submissions send no message, and
    the placement tick (1 s in tests) still places them."""
    from app.outbox import kicks
    from tests.fixtures.workloads import ALL, fleet

    world.fleet(fleet(1))
    t = world.tenant("kickless", policy=ALL)
    key = world.key(t)
    r = redis.Redis.from_url(REDIS_URL)
    region = "r1"
    r.set(kicks._name("placement.cycle", region), b"1", px=60_000)  # muted for a minute
    try:
        wid = client.post(
            "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)
        ).json()["id"]
        wait_until(
            lambda: (
                client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "running"
            ),
            timeout=30,
        )
    finally:
        r.delete(kicks._name("placement.cycle", region))
