"""/metrics shows the fleet's health as the database records it (whichever process acted)."""

from __future__ import annotations

import time
from datetime import timedelta

from prometheus_client.parser import text_string_to_metric_families

from app.core.db import session_scope, utcnow
from app.health.tasks import add_idle_iron
from tests.test_health_service import FLEET, _evaluate


def _samples(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gpus_by_health_and_allocation_incidents_and_idle_iron(client, world):
    world.fleet(FLEET)  # 3 nodes x 8 H100 in r1
    _evaluate("h1", (3, 48, time.time()))  # GPU 3 of h1 is taken out for a reset
    _evaluate("h2", (0, 13, time.time()))  # an application error: nothing taken out
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
