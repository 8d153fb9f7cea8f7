"""Redis through Sentinel (issue 38): one `REDIS_URL` of the form
`redis+sentinel://host:port,.../master` gives the client, the asyncio client, the pub/sub
listeners and Celery's broker the master the Sentinels name, and they follow it when the master
is killed and a replica promoted. Real engines: a Redis master, a replica and a Sentinel
(Debian's redis-sentinel, which `make test` installs), on ports of their own."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.world import wait_until

pytestmark = pytest.mark.skipif(
    shutil.which("redis-sentinel") is None or shutil.which("redis-server") is None,
    reason="redis-sentinel is not installed (make test installs it: scripts/ensure-ha.sh)",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trio:
    """A master, a replica and one Sentinel (quorum 1), failing over within seconds."""

    def __init__(self, root: Path):
        self.root = root
        self.ports = {"a": _port(), "b": _port(), "sentinel": _port()}
        self.procs: dict[str, subprocess.Popen] = {}

    def _redis(self, name: str, *extra: str) -> None:
        argv = ["redis-server", "--port", str(self.ports[name]), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.root), *extra]
        log = open(self.root / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> None:
        self._redis("a")
        self._redis("b", "--replicaof", "127.0.0.1", str(self.ports["a"]))
        conf = self.root / "sentinel.conf"
        conf.write_text(
            f"port {self.ports['sentinel']}\nbind 127.0.0.1\ndir {self.root}\n"
            f"sentinel monitor rackplane 127.0.0.1 {self.ports['a']} 1\n"
            "sentinel down-after-milliseconds rackplane 1000\n"
            "sentinel failover-timeout rackplane 5000\n"
            "sentinel parallel-syncs rackplane 1\n"
        )
        log = open(self.root / "sentinel.log", "wb")
        self.procs["sentinel"] = subprocess.Popen(
            ["redis-sentinel", str(conf)], stdout=log, stderr=subprocess.STDOUT
        )
        import redis

        def ready() -> bool:
            try:
                s = redis.Redis(port=self.ports["sentinel"], socket_timeout=0.5)
                replicas = s.sentinel_slaves("rackplane")
                return any(r.get("master-link-status") == "ok" for r in replicas)
            except Exception:
                return False

        wait_until(ready, timeout=30, interval=0.2)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.ports['sentinel']}/rackplane"

    def master(self) -> str:
        import redis

        host, port = redis.Redis(port=self.ports["sentinel"]).sentinel_get_master_addr_by_name(
            "rackplane"
        )
        return next(n for n, p in self.ports.items() if p == int(port))

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def trio(tmp_path):
    t = Trio(tmp_path)
    try:
        t.start()
        yield t
    finally:
        t.stop()


def test_clients_broker_and_listeners_follow_the_master_through_a_failover(trio, monkeypatch):
    from kombu import Connection

    from app.core import redis as rp_redis
    from app.core.broker import celery_settings
    from app.core.config import Settings

    url = trio.url
    assert rp_redis.sentinel_parts(url)[1:] == ("rackplane", 0, None)
    c = rp_redis.connect(url, socket_timeout=1, socket_connect_timeout=1)
    c.set("rp:before", "1")
    assert c.get("rp:before") == b"1"

    # Celery's broker through Sentinel: a message put and got back.
    settings = Settings(REDIS_URL=url, RACKPLANE_BROKER_PREFIX="rp-ha:")
    conf = celery_settings(settings)
    assert conf["broker_url"] == f"sentinel://127.0.0.1:{trio.ports['sentinel']}"
    assert conf["broker_transport_options"]["master_name"] == "rackplane"
    with Connection(conf["broker_url"], transport_options=conf["broker_transport_options"]) as k:
        q = k.SimpleQueue("rp-ha-probe")
        q.put({"n": 1})
        m = q.get(timeout=5)
        assert m.payload == {"n": 1}
        m.ack()
        q.close()

    # A pub/sub listener (as the API's auth-epoch and topic listeners run).
    got: list[bytes] = []
    downs: list[str] = []
    threading.Thread(
        target=rp_redis.follow,
        args=(
            url,
            lambda p: p.subscribe("rp:topic"),
            lambda m: got.append(m["data"]) if m["type"] == "message" else None,
            lambda exc: downs.append(type(exc).__name__),
            0.2,
        ),
        daemon=True,
    ).start()
    wait_until(lambda: c.publish("rp:topic", "one") > 0, timeout=10, interval=0.1)
    wait_until(lambda: b"one" in got, timeout=10)

    # The master dies: the Sentinel promotes the replica; every path finds it.
    assert trio.master() == "a"
    killed = time.monotonic()
    trio.kill("a")

    def writes() -> bool:
        try:
            return bool(c.set("rp:after", "2"))
        except Exception:
            return False

    wait_until(writes, timeout=30, interval=0.1)
    took = time.monotonic() - killed
    assert trio.master() == "b"
    assert c.get("rp:before") == b"1", "what was written before the failover is there"
    print(f"redis writes again {took:.1f} s after the master's SIGKILL")  # the bench measures
    wait_until(lambda: c.publish("rp:topic", "two") > 0, timeout=20, interval=0.2)
    wait_until(lambda: b"two" in got, timeout=10)
    assert downs, "the listener saw its connection go, and came back"
    with Connection(conf["broker_url"], transport_options=conf["broker_transport_options"]) as k:
        q = k.SimpleQueue("rp-ha-probe")
        q.put({"n": 2})
        m = q.get(timeout=5)
        assert m.payload == {"n": 2}, "the acknowledged message is not sent again"
        m.ack()
        q.close()
