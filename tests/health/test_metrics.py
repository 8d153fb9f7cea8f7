"""/metrics shows the fleet's health as the database records it (whichever process acted)."""

from __future__ import annotations

import time
from datetime import timedelta

from prometheus_client.parser import text_string_to_metric_families

from app.core.db import session_scope, utcnow
from app.health.tasks import add_idle_iron
from tests.fixtures.health import xid_burst
from tests.fixtures.workloads import fleet


def _samples(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gpus_by_health_and_allocation_incidents_and_idle_iron(client, world):
    world.fleet(fleet(3))  # 3 nodes x 8 H100 in r1
    xid_burst("h1", (3, 48, time.time()))  # GPU 3 of h1 is taken out for a reset
    xid_burst("h2", (0, 13, time.time()))  # an application error: nothing taken out
    m = _samples(client)
    gpus = {dict(k[1])["health"]: v for k, v in m.items() if k[0] == "rackplane_gpus"}
    assert sum(gpus.values()) == 24
    # GPU 3 of h1 is out (a worker may already have repaired it: then it is back).
    assert gpus["healthy"] == 23 or (gpus["healthy"] == 24 and "repairing" not in gpus)
    alloc = {k[1][2][1]: v for k, v in m.items() if k[0] == "rackplane_gpus_allocation"}
    assert alloc.get("allocated", 0) == 0 and alloc["idle"] + alloc.get("unavailable", 0) == 24
    assert (
        m[
            (
                "rackplane_health_incidents_total",
                (("action", "reset_gpu"), ("signal", "xid"), ("xid", "48")),
            )
        ]
        == 1
    )
    assert (
        m[
            (
                "rackplane_health_incidents_total",
                (("action", "none"), ("signal", "xid"), ("xid", "13")),
            )
        ]
        == 1
    )
    # Idle iron: each sweep adds the idle GPUs times the time since the last.
    with session_scope() as s:
        add_idle_iron(s, utcnow() - timedelta(seconds=1))
    with session_scope() as s:
        idle_now = add_idle_iron(s, utcnow())
    got = _samples(client)[
        ("rackplane_idle_gpu_seconds_total", (("model", "H100-80GB"), ("region", "r1")))
    ]
    assert idle_now in (23, 24) and 0.9 * idle_now <= got <= 1.2 * idle_now


def test_placement_cycles_and_queue_waits_are_on_metrics(client, world, celery_worker_process):
    from tests.fixtures.workloads import ALL
    from tests.fixtures.world import auth, wait_until

    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    w = client.post("/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key))
    big = client.post("/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key))
    assert w.status_code == big.status_code == 201
    count = ("rackplane_placement_cycle_seconds_count", (("region", "r1"),))
    m = wait_until(lambda: (x := _samples(client)).get(count, 0) >= 1 and x, timeout=20)
    inf = ("rackplane_placement_cycle_seconds_bucket", (("le", "+Inf"), ("region", "r1")))
    assert m[inf] == m[count]
    # One of the two waits (the node holds one): a queue wait is shown for its priority.
    waiting = {k: v for k, v in m.items() if k[0] == "rackplane_queue_wait_seconds_count"}
    assert sum(waiting.values()) == 1
