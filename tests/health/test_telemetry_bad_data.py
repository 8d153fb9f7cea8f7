"""Bad telemetry never takes out a GPU (real PostgreSQL, the real API): each case of issue S4
replayed. A value outside its field's domain (an Xid of -1 or past int32, a negative or
infinite counter, NaN or Inf where a reading cannot be one, NUL in a label, a stamp years
ahead) is rejected per sample, counted in the answer and on /metrics, and never acted on; the
rest of the batch still applies; none of it is a 500. A UUID resolves only to the GPU whose
record holds it, or to nothing: a sample claiming another GPU's UUID is refused and changes no
mapping.

Where nothing may be acted on, the test looks at what was sent to the health loop (no
`health.evaluate` message); where the right GPU must be, a real worker acts and the test reads
the health history."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from app.core.config import get_settings
from app.core.db import as_aware
from app.health import tasks
from tests.fixtures.health import evaluations, exporter_text, history, push
from tests.fixtures.workloads import fleet
from tests.fixtures.world import wait_until

FLEET = fleet(2)  # h1, h2: HGX H100 x8
TEN_YEARS_MS = 10 * 365 * 86_400_000
GOOD = 'DCGM_FI_DEV_GPU_TEMP{gpu="7",Hostname="h1"} 41\n'  # one good sample in every batch


def _line(field: str, value: str, labels: str = 'gpu="0",Hostname="h1"', ts: str = "") -> str:
    return f"{field}{{{labels}}} {value}{ts}\n"


def _json(*samples: dict) -> str:
    return json.dumps({"samples": list(samples)})


def _health(session) -> dict[tuple[str, int | None], str]:
    """Every node's and GPU's health state, by (node, GPU index or None)."""
    session.rollback()
    out = {(n, None): h for n, h in session.execute(text("SELECT name, health FROM nodes"))}
    for n, i, h in session.execute(
        text("SELECT n.name, g.index, g.health FROM gpus g JOIN nodes n ON n.id = g.node_id")
    ):
        out[(n, i)] = h
    return out


def _uuids(session) -> dict[tuple[str, int], str]:
    session.rollback()
    return {
        (n, i): u
        for n, i, u in session.execute(
            text(
                "SELECT n.name, g.index, g.uuid FROM gpus g JOIN nodes n ON n.id = g.node_id "
                "WHERE g.uuid IS NOT NULL"
            )
        )
    }


def _node_id(session, name: str):
    session.rollback()
    return session.execute(text("SELECT id FROM nodes WHERE name = :n"), {"n": name}).scalar()


def _moved(session) -> set[tuple[str, int | None]]:
    """The nodes and GPUs (node, GPU index or None) with a health history."""
    session.rollback()
    return set(
        session.execute(
            text("SELECT n.name, e.gpu_index FROM health_events e JOIN nodes n ON n.id = e.node_id")
        ).all()
    )


def _rejected_on_metrics(client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
        if s.name == "rackplane_telemetry_rejected_samples_total"
    }


# (case, content type, body, accepted, rejected by reason): each batch also carries GOOD (or
# its JSON twin), which is taken in whatever the rest of the batch is.
TEXT = "text/plain; version=0.0.4"
JSON = "application/json"
GOOD_JSON = {"node": "h1", "gpu": 7, "field": "DCGM_FI_DEV_GPU_TEMP", "value": 41}
CASES = [
    ("xid -1", TEXT, _line("DCGM_FI_DEV_XID_ERRORS", "-1"), {"out_of_range": 1}),
    (
        "xid -1 (json)",
        JSON,
        _json({"node": "h1", "gpu": 0, "field": "DCGM_FI_DEV_XID_ERRORS", "value": -1}),
        {"out_of_range": 1},
    ),
    ("xid past int32", TEXT, _line("DCGM_FI_DEV_XID_ERRORS", "2147483648"), {"out_of_range": 1}),
    (
        "xid past int32 (json)",
        JSON,
        _json({"node": "h1", "gpu": 0, "field": "DCGM_FI_DEV_XID_ERRORS", "value": 4294967296}),
        {"out_of_range": 1},
    ),
    ("xid not whole", TEXT, _line("DCGM_FI_DEV_XID_ERRORS", "48.5"), {"out_of_range": 1}),
    (
        "recovery action past int32",
        TEXT,
        _line("DCGM_FI_DEV_GPU_RECOVERY_ACTION", "1e12"),
        {"out_of_range": 1},
    ),
    ("xid +Inf", TEXT, _line("DCGM_FI_DEV_XID_ERRORS", "+Inf"), {"not_finite": 1}),
    ("xid NaN", TEXT, _line("DCGM_FI_DEV_XID_ERRORS", "NaN"), {"not_finite": 1}),
    ("ecc -Inf", TEXT, _line("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "-Inf"), {"not_finite": 1}),
    (
        "gauges +Inf and -Inf",
        TEXT,
        _line("DCGM_FI_DEV_GPU_TEMP", "+Inf") + _line("DCGM_FI_DEV_POWER_USAGE", "-Inf"),
        {"not_finite": 2},
    ),
    (
        "gauges outside physical bounds",
        TEXT,
        _line("DCGM_FI_DEV_GPU_TEMP", "5000")
        + _line("DCGM_FI_DEV_GPU_UTIL", "250")
        + _line("DCGM_FI_DEV_POWER_USAGE", "-3")
        + _line("DCGM_FI_DEV_SM_CLOCK", "1e9"),
        {"out_of_range": 4},
    ),
    (
        "NUL in the UUID label",
        TEXT,
        _line("DCGM_FI_DEV_XID_ERRORS", "48", 'gpu="0",UUID="GPU-\x00abc",Hostname="h1"'),
        {"bad_label": 1},
    ),
    (
        "NUL in the Hostname label",
        TEXT,
        _line("DCGM_FI_DEV_XID_ERRORS", "48", 'gpu="0",Hostname="h\x001"'),
        {"bad_label": 1},
    ),
    (
        "control character in another label",
        TEXT,
        _line("DCGM_FI_DEV_XID_ERRORS", "48", 'gpu="0",modelName="H100\x07",Hostname="h1"'),
        {"bad_label": 1},
    ),
    (
        "not a GPU index",
        TEXT,
        _line("DCGM_FI_DEV_XID_ERRORS", "48", 'gpu="0x1",Hostname="h1"'),
        {"bad_label": 1},
    ),
    (
        "stamped ten years ahead",
        TEXT,
        _line("DCGM_FI_DEV_XID_ERRORS", "48", ts=f" {int(time.time() * 1000) + TEN_YEARS_MS}"),
        {"future_timestamp": 1},
    ),
    (
        "stamped ten years ahead (json)",
        JSON,
        _json(
            {
                "node": "h1",
                "gpu": 0,
                "field": "DCGM_FI_DEV_XID_ERRORS",
                "value": 48,
                "timestamp": "2099-01-01T00:00:00Z",
            }
        ),
        {"future_timestamp": 1},
    ),
]


@pytest.mark.parametrize(
    ("ctype", "body", "rejected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_value_outside_its_domain_is_rejected_per_sample_and_never_acted_on(
    client, world, session, ctype, body, rejected
):
    world.fleet(FLEET)
    op = world.key(None)
    before = _health(session)
    counted = _rejected_on_metrics(client)
    if ctype == JSON:
        doc = json.loads(body)
        body = json.dumps({"samples": [*doc["samples"], GOOD_JSON]})
    else:
        body += GOOD
    r = push(client, op, body.encode(), ctype)
    assert r.status_code == 200, r.text
    got = r.json()
    # Nothing acted on: nothing sent to the health loop, no GPU or node moved.
    assert got["signals"] == 0 and evaluations(session) == []
    assert _health(session) == before and set(before.values()) == {"healthy"}
    # The rest of the batch still applies; the rejected samples are counted, with why.
    n = sum(rejected.values())
    assert got["accepted"] == 1 and got["unknown_count"] == 0
    assert got["rejected"] == n and got["rejected_by_reason"] == rejected
    assert len(got["rejections"]) == n
    assert {x["reason"] for x in got["rejections"]} == set(rejected)
    assert all(x["field"].startswith("DCGM_FI_DEV_") for x in got["rejections"])
    # Counted on /metrics too.
    now = _rejected_on_metrics(client)
    assert {k: now[k] - counted.get(k, 0) for k in rejected} == rejected


def test_a_counter_going_negative_then_back_to_zero_is_no_error_burst(client, world, session):
    world.fleet(FLEET)
    op = world.key(None)
    field = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
    first = push(client, op, exporter_text("h1", {field: {0: -5}})).json()
    r = push(client, op, exporter_text("h1", {field: {0: 0}})).json()
    assert first["signals"] == 0 and r["signals"] == 0 and evaluations(session) == []
    assert first["rejected_by_reason"] == {"out_of_range": 1} and first["accepted"] == 0
    assert r["accepted"] == 1 and r["rejected"] == 0
    # A counter going down is the exporter's reset: a new baseline, never an error burst.
    for value, raised in ((7, 1), (2, 0), (2, 0), (0, 0)):
        r = push(client, op, exporter_text("h1", {field: {0: value}})).json()
        assert r["rejected"] == 0 and r["signals"] == raised, (value, r)
    # The one real rise (0 -> 7) is what was sent to the health loop.
    assert [
        (s["gpu_index"], s["signal"], s["value"])
        for e in evaluations(session)
        for s in e["signals"]
    ] == [(0, "ecc_dbe", 7.0)]


def test_a_uuid_resolves_to_the_gpu_that_has_it_or_to_nothing(
    client, world, session, celery_worker_process
):
    world.fleet(FLEET)
    op = world.key(None)
    a0 = "GPU-h1-0000-aaaa"
    # Both nodes report: each GPU's UUID is learned from its own labels.
    temps = {"DCGM_FI_DEV_GPU_TEMP": {0: 40, 1: 40}}
    assert push(client, op, exporter_text("h1", temps)).json()["accepted"] == 2
    assert push(client, op, exporter_text("h2", temps)).json()["accepted"] == 2
    learned = _uuids(session)
    assert learned[("h1", 0)] == a0 and len(learned) == 4
    # Node h2's GPU 0 claims node h1's GPU 0's UUID (and an Xid names h2 and that UUID):
    # refused, and no mapping changes; the batch's good sample still applies.
    claim = (
        _line("DCGM_FI_DEV_GPU_TEMP", "40", f'gpu="0",UUID="{a0}",Hostname="h2"')
        + _line("DCGM_FI_DEV_XID_ERRORS", "48", f'UUID="{a0}",Hostname="h2"')
        + _line("DCGM_FI_DEV_GPU_TEMP", "40", 'gpu="1",UUID="GPU-h2-0001-aaaa",Hostname="h2"')
    )
    refused = push(client, op, claim)
    assert _uuids(session) == learned
    # An Xid sent by that UUID alone resets the GPU that has it: h1's GPU 0, not h2's.
    r = push(client, op, _line("DCGM_FI_DEV_XID_ERRORS", "48", f'UUID="{a0}"')).json()
    assert r["accepted"] == 1 and r["signals"] == 1
    [ev] = evaluations(session)
    assert ev["node_id"] == str(_node_id(session, "h1"))
    assert [(s["gpu_index"], s["code"]) for s in ev["signals"]] == [(0, 48)]
    assert refused.status_code == 200, refused.text
    got = refused.json()
    assert got["rejected_by_reason"] == {"uuid_conflict": 2} and got["accepted"] == 1
    assert got["signals"] == 0
    wait_until(lambda: history(session, "h1", 0)[:1] == ["quarantined"], timeout=15)
    assert _moved(session) == {("h1", 0)}
    assert history(session, "h2", 0) == []
    # An Xid from a UUID no GPU has is unresolved: counted, not acted on.
    r = push(client, op, _line("DCGM_FI_DEV_XID_ERRORS", "79", 'UUID="GPU-nobody"')).json()
    assert r["accepted"] == 0 and r["signals"] == 0 and r["unknown_count"] == 1
    assert r["unknown"][0]["problem"] == "unknown_gpu"
    assert len(evaluations(session)) == 1
    assert _uuids(session) == learned


def test_a_sample_stamped_years_ahead_does_not_stop_the_nodes_heartbeats(
    client, world, session, monkeypatch
):
    """Twin nodes report twice a second; one of them once sent a sample stamped ten years
    ahead. Both keep their heartbeats, and the sweep finds neither silent."""
    world.fleet(FLEET)
    op = world.key(None)
    monkeypatch.setattr(get_settings(), "heartbeat_timeout_seconds", 3.0)  # a beat a second
    ahead = int(time.time() * 1000) + TEN_YEARS_MS
    stamped = push(client, op, exporter_text("h1", {"DCGM_FI_DEV_GPU_TEMP": {0: 40}}, ahead))
    started = time.time()
    while time.time() - started < 4.5:
        for host in ("h1", "h2"):
            body = exporter_text(host, {"DCGM_FI_DEV_GPU_TEMP": {0: 40}}, int(time.time() * 1000))
            assert push(client, op, body).json()["accepted"] == 1
        time.sleep(0.5)
    session.rollback()
    now = datetime.now(UTC)
    age = {
        name: (now - as_aware(seen)).total_seconds()
        for name, seen in session.execute(
            text(
                "SELECT n.name, b.last_seen_at FROM node_heartbeats b "
                "JOIN nodes n ON n.id = b.node_id"
            )
        )
    }
    assert age.keys() == {"h1", "h2"} and all(v < 2.0 for v in age.values()), age
    tasks.sweep()  # what the beat runs: silent nodes get a `heartbeat_lost` signal
    assert evaluations(session) == []
    assert set(_health(session).values()) == {"healthy"}
    assert stamped.json()["rejected_by_reason"] == {"future_timestamp": 1}


def test_a_telemetry_body_is_not_read_before_the_key_is_checked(app):
    """Issue 45 item 17: the admin telemetry route read a 30 MiB body before it checked the
    key. Without one, the 401 comes having read at most the first chunk."""
    import anyio

    chunk, chunks = b"x" * (1 << 20), 30
    read = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": read < chunks}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/admin/telemetry",
        "raw_path": b"/v1/admin/telemetry",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"text/plain"),
            (b"content-length", str(len(chunk) * chunks).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
        "state": {},
    }
    anyio.run(app, scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 401
    assert read <= 1, f"{read} MiB read before the key was checked"
