"""The `ha` profile of docker-compose.yml describes the topology `make ha` runs (docs/ha.md), with
the same Patroni settings as rackplane_bench/ha.py, and the app reaches it the same way. No
container engine runs here, so this reads the files; the topology itself is tested by
tests/ha/test_failover.py."""

from __future__ import annotations

from collections import Counter

import yaml

from rackplane_bench import ha
from tests.fixtures.harness import ROOT


def test_the_compose_ha_profile_is_the_topology_make_ha_runs():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    ha_roles = Counter(
        name.rstrip("0123456789")
        for name, s in services.items()
        if "ha" in s.get("profiles", []) and name != "migrate"
    )
    assert ha_roles == {
        "etcd": 1, "pg": 3, "redis": 3, "sentinel": 3, "api": 2, "worker": 2, "beat": 1
    }  # fmt: skip
    assert all("ha" not in s.get("profiles", []) for n, s in services.items() if n == "postgres")
    dcs = yaml.safe_load((ROOT / "deploy" / "ha" / "patroni.yml").read_text())["bootstrap"]["dcs"]
    assert (dcs["ttl"], dcs["loop_wait"], dcs["retry_timeout"]) == (
        ha.TTL, ha.LOOP_WAIT, ha.RETRY_TIMEOUT
    )  # fmt: skip
    assert dcs["synchronous_mode"] is True
    env = services["api1"]["environment"]
    assert "target_session_attrs=read-write" in env["DATABASE_URL"]
    assert all(f"host=pg{i}:5432" in env["DATABASE_URL"] for i in (1, 2, 3))
    assert env["REDIS_URL"].startswith("redis+sentinel://") and env["REDIS_URL"].endswith(
        f"/{ha.SCOPE}"
    )
    sentinel = (ROOT / "deploy" / "ha" / "sentinel.conf").read_text()
    assert f"sentinel monitor {ha.SCOPE} redis1 6379 2" in sentinel
    # The image carries what the API imports.
    docker = (ROOT / "Dockerfile").read_text()
    assert all(f"COPY {p} " in docker for p in ("app", "workers", "rackplane_wire"))
