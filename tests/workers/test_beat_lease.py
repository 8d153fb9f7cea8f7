"""Exactly one beat sends each schedule even when two run (issue 38): a lease in Redis, held
by one beat, taken over by the other once its holder is killed. Real beat processes on the
tests' Redis, under a broker prefix of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.fixtures.harness import REDIS_URL, ROOT
from tests.fixtures.world import wait_until


def test_the_lease_is_held_by_one_and_taken_over_when_its_holder_stops_renewing():
    from workers.beat import Lease

    key = f"rptest-lease-{uuid.uuid4().hex[:8]}"
    a, b = Lease(REDIS_URL, key, ttl_s=1.0), Lease(REDIS_URL, key, ttl_s=1.0)
    assert a.hold() and not b.hold()
    assert a.hold(), "its holder renews it"
    time.sleep(1.3)  # a stops renewing (killed, hung, cut off)
    assert b.hold() and not a.hold()
    b.release()
    assert a.hold(), "a clean stop hands it over at once"
    a.release()


def _sends(log: Path) -> int:
    return log.read_text(errors="replace").count("Sending due task") if log.exists() else 0


def test_two_beats_send_each_schedule_once_and_the_survivor_takes_over(tmp_path):
    prefix = f"rptest-beat-{uuid.uuid4().hex[:8]}:"
    beats: dict[str, subprocess.Popen] = {}
    logs = {n: tmp_path / f"{n}.log" for n in ("a", "b")}
    for name in ("a", "b"):
        data = tmp_path / name
        data.mkdir()
        env = {
            **os.environ,
            "RACKPLANE_BROKER_PREFIX": prefix,
            "RACKPLANE_DATA_DIR": str(data),
            "RACKPLANE_PLACEMENT_TICK": "1",
            "RACKPLANE_LOG_LEVEL": "INFO",
        }
        argv = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "beat"]
        argv += ["--loglevel", "INFO", "-s", str(data / "schedule")]
        beats[name] = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=open(logs[name], "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: _sends(logs["a"]) + _sends(logs["b"]) >= 5, timeout=40)
        time.sleep(3)
        sent = {n: _sends(logs[n]) for n in logs}
        leader = max(sent, key=sent.get)
        other = "b" if leader == "a" else "a"
        assert sent[other] == 0, sent  # one sends, the other waits
        os.killpg(beats[leader].pid, signal.SIGKILL)
        beats[leader].wait(timeout=10)
        wait_until(lambda: _sends(logs[other]) > 0, timeout=40)
        assert "beat_lease_taken" in logs[other].read_text(errors="replace")
    finally:
        for p in beats.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        for k in r.scan_iter(match=f"{prefix}*", count=1000):
            r.delete(k)
