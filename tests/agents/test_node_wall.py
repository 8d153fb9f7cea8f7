"""What a node's credential can do, when its agent's host is not to be trusted with more than its
own runs (issue 44, section 0): log writes only into the runs it holds, a rotate that retires
the credential presented exactly once, no GPU UUID taken from another node, and a bucket and
body caps of its own. Each is also a row of tests/api/test_security_matrix.py."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from tests.fixtures.agent_api import AGENT_FLEET, bring_up, fake_inventory, join_node
from tests.fixtures.logs import log_chunk, placed_workload, read_logs
from tests.fixtures.world import SMALL_FLEET, auth, wait_until


def _logs(client, cred: str, chunks: list[dict]) -> dict:
    r = client.post("/v1/agent/logs", json={"chunks": chunks}, headers=auth(cred))
    assert r.status_code == 200, r.text
    return r.json()


# --- a node writes only into the runs it holds --------------------------------------------------


def test_a_node_writes_only_the_logs_of_the_attempt_it_holds(client, world, celery_worker_process):
    """A node that held a workload's first attempt ships that attempt's output, its tail after
    the run ended included, but nothing into the attempt that runs on another node now; the
    node of the second attempt writes nothing into the first."""
    key, wid, creds, holders = placed_workload(client, world)
    first = holders[0]
    second = next(n for n in creds if n != first)
    assert _logs(client, creds[first], [log_chunk(wid, 0, "one\n", attempt=1)]) == {
        "accepted": 1,
        "stale": 0,
    }

    # The first node goes down: the workload is requeued and placed on the other node.
    op = world.key()
    nodes = client.get("/v1/admin/nodes", params={"limit": 50}, headers=auth(op)).json()
    node_id = next(n["id"] for n in nodes["items"] if n["name"] == first)
    down = client.patch(f"/v1/admin/nodes/{node_id}", json={"state": "down"}, headers=auth(op))
    assert down.status_code == 200, down.text

    def moved():
        w = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
        return w["attempts"] == 2 and w["placement"] and w["placement"][0]["node"] == second

    wait_until(moved, timeout=30)

    # The first node: its attempt's tail, yes; the second attempt, no.
    assert _logs(
        client,
        creds[first],
        [log_chunk(wid, 4, "tail\n", attempt=1), log_chunk(wid, 0, "forged\n", attempt=2)],
    ) == {"accepted": 1, "stale": 1}
    # The second node: its own attempt, yes; the first attempt's, no.
    assert _logs(
        client,
        creds[second],
        [log_chunk(wid, 0, "two\n", attempt=2), log_chunk(wid, 9, "forged\n", attempt=1)],
    ) == {"accepted": 1, "stale": 1}
    page = read_logs(client, key, wid)
    assert [(i["attempt"], i["offset"], i["data"]) for i in page["items"]] == [
        (1, 0, "one\n"),
        (1, 4, "tail\n"),
        (2, 0, "two\n"),
    ]


# --- a rotate retires the credential presented, once --------------------------------------------


def _credential(client, world, node: str = "h100-1") -> str:
    world.fleet(SMALL_FLEET)
    return join_node(client, world.key(), node)


def _live(session) -> int:
    from app.models.agents import NodeCredential

    session.expire_all()
    return session.scalar(
        select(func.count()).select_from(NodeCredential).where(NodeCredential.revoked_at.is_(None))
    )


def test_concurrent_rotates_with_one_credential_mint_one_live_credential(client, world, session):
    from app.agents import service
    from app.core.db import session_scope
    from app.core.errors import AppError
    from app.tenancy.nodes import node_of

    cred = _credential(client, world)
    caller = node_of(session, cred)
    assert caller is not None
    start = threading.Barrier(4)

    def rotate(_: int) -> str:
        start.wait()
        try:
            with session_scope() as s:
                return service.rotate(s, caller).credential
        except AppError as e:
            return e.code

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(rotate, range(4)))
    minted = [r for r in results if r.startswith("rpn_")]
    assert len(minted) == 1, results
    assert results.count("invalid_node_credential") == 3
    assert _live(session) == 1
    assert client.get("/v1/agent/node", headers=auth(minted[0])).status_code == 200
    assert client.get("/v1/agent/node", headers=auth(cred)).status_code == 401


def test_concurrent_rotate_requests_get_one_201_and_the_old_credential_stops(
    client, world, session
):
    from app.tenancy.credentials import hash_secret
    from app.tenancy.principals import _cache

    cred = _credential(client, world)
    # This process's cache holds it once checked, and must let it go at the rotate's commit.
    cached = "n:" + hash_secret(cred)
    wait_until(
        lambda: (
            client.get("/v1/agent/node", headers=auth(cred)).status_code == 200
            and cached in _cache.entries
        ),
        timeout=10,
    )
    start = threading.Barrier(4)

    def rotate(_: int):
        start.wait()
        return client.post("/v1/agent/credentials:rotate", headers=auth(cred))

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(rotate, range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201, 401, 401, 401], [r.text for r in answers]
    for r in answers:
        if r.status_code == 401:
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["code"] == "invalid_node_credential"
    assert _live(session) == 1
    fresh = next(r for r in answers if r.status_code == 201).json()["credential"]
    assert cached not in _cache.entries
    assert client.get("/v1/agent/node", headers=auth(cred)).status_code == 401
    assert client.get("/v1/agent/node", headers=auth(fresh)).status_code == 200
    # The retired credential cannot rotate again, however often it tries.
    again = client.post("/v1/agent/credentials:rotate", headers=auth(cred))
    assert again.status_code == 401 and again.json()["code"] == "invalid_node_credential"
    assert _live(session) == 1


# --- a GPU UUID another node holds is refused, named --------------------------------------------


def test_an_inventory_claiming_another_nodes_gpu_uuid_is_a_named_difference(client, world, session):
    from app.models.fleet import Gpu, Node

    world.fleet(AGENT_FLEET)
    op = world.key()
    a1, a2 = join_node(client, op, "a-1"), join_node(client, op, "a-2")
    assert bring_up(client, a1, fake_inventory("a-1")).json()["matches"]

    # a-2's GPU 2 claims a UUID the fleet records on a-1's GPU 1.
    claimed = fake_inventory("a-2")
    claimed["gpus"][2]["uuid"] = "GPU-a-1-0001"
    verdict = client.put("/v1/agent/inventory", json=claimed, headers=auth(a2))
    assert verdict.status_code == 200, verdict.text
    v = verdict.json()
    assert not v["matches"] and v["node_state"] == "validating"
    assert v["differences"] == [
        "GPU 2 reports GPU-a-1-0001, which the fleet records on node a-1 GPU 1"
    ]

    def uuids(node: str) -> dict[int, str | None]:
        session.expire_all()
        rows = session.execute(
            select(Gpu.index, Gpu.uuid).join(Node, Node.id == Gpu.node_id).where(Node.name == node)
        )
        return dict(rows.all())

    # Nothing moved, nothing learned from an inventory that differs.
    assert uuids("a-1")[1] == "GPU-a-1-0001"
    assert set(uuids("a-2").values()) == {None}
    node = session.scalar(select(Node).where(Node.name == "a-2"))
    assert "which the fleet records on node a-1 GPU 1" in node.state_reason
    # Telemetry about that UUID still lands on a-1's GPU.
    text = 'DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a-1-0001"} 61\n'
    pushed = client.post("/v1/agent/telemetry", content=text, headers=auth(a1))
    assert pushed.status_code == 200 and pushed.json()["accepted"] == 1, pushed.text

    # The host's own UUIDs: it matches, and they are learned.
    assert bring_up(client, a2, fake_inventory("a-2")).json()["matches"]
    assert uuids("a-2") == {i: f"GPU-a-2-{i:04d}" for i in range(4)}
    assert uuids("a-1")[1] == "GPU-a-1-0001"


# --- a node's bucket and body caps ----------------------------------------------------------------


@pytest.fixture
def node_limits(monkeypatch):
    from app.core.config import get_settings
    from app.ratelimit import service

    def set_limits(per_second: float, burst: float) -> None:
        s = get_settings()
        monkeypatch.setattr(s, "agent_rate_limit", per_second)
        monkeypatch.setattr(s, "agent_rate_burst", burst)
        # Fresh buckets: a new prefix for this test's keys in Redis.
        monkeypatch.setattr(s, "broker_key_prefix", f"{s.broker_key_prefix}rl{time.time_ns()}:")

    yield set_limits
    service._local.buckets.clear()


def test_each_node_has_a_bucket_of_its_own(client, world, node_limits):
    world.fleet(SMALL_FLEET)
    op = world.key()
    one, two = join_node(client, op, "h100-1"), join_node(client, op, "h100-2")
    node_limits(per_second=0.05, burst=3)  # three, then one per 20 s
    seen = []
    for _ in range(3):
        r = client.get("/v1/agent/node", headers=auth(one))
        assert r.status_code == 200, r.text
        seen.append(int(r.headers["ratelimit-remaining"]))
    assert seen == [2, 1, 0]
    # Any agent route draws on the node's bucket: reports and logs too.
    for method, path, body in (
        ("GET", "/v1/agent/node", None),
        ("POST", "/v1/agent/status", {}),
        ("POST", "/v1/agent/logs", {"chunks": []}),
    ):
        refused = client.request(method, path, json=body, headers=auth(one))
        assert refused.status_code == 429, (path, refused.text)
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["code"] == "rate_limited"
        assert refused.json()["limit_class"] == "node"
        assert 1 <= int(refused.headers["retry-after"]) <= 20
    # Another node's agent is untouched; a credential that is not one pays as anonymous (401).
    assert client.get("/v1/agent/node", headers=auth(two)).status_code == 200
    forged = client.get("/v1/agent/node", headers=auth("rpn_" + "A" * 40))
    assert forged.status_code == 401


def test_the_default_bucket_takes_a_real_agents_pace(client, world):
    """A second of an agent's traffic at its busiest (a burst after a restart: inventory,
    assignments, a status report, logs and telemetry, twice over) is nowhere near the limit."""
    world.fleet(SMALL_FLEET)
    cred = join_node(client, world.key(), "h100-1")
    answers = []
    for _ in range(10):
        answers += [
            client.get("/v1/agent/assignments", params={"wait": "0s"}, headers=auth(cred)),
            client.post("/v1/agent/status", json={}, headers=auth(cred)),
            client.post("/v1/agent/logs", json={"chunks": []}, headers=auth(cred)),
        ]
    assert {r.status_code for r in answers} == {200}
    assert int(answers[-1].headers["ratelimit-remaining"]) >= 50


def _scrape(node: str, gpus: int = 8, fields: int = 40) -> str:
    """dcgm-exporter's text for one node, with its full label set (the default counters are
    about 40 fields)."""
    lines = []
    for f in range(fields):
        name = f"DCGM_FI_DEV_FIELD_{f}"
        lines.append(f"# HELP {name} A field.\n# TYPE {name} gauge")
        for g in range(gpus):
            lines.append(
                f'{name}{{gpu="{g}",UUID="GPU-{node}-{g:04d}",pci_bus_id="00000000:{0x18 + g:02X}'
                f':00.0",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="{node}",'
                f'DCGM_FI_DRIVER_VERSION="560.35.03",container="",namespace="",pod=""}} 42'
            )
    return "\n".join(lines) + "\n"


def test_agent_pushes_have_their_own_body_caps(client, world):
    from app.core.config import get_settings

    s = get_settings()
    world.fleet(SMALL_FLEET)
    cred = join_node(client, world.key(), "h100-1")
    text = {**auth(cred), "content-type": "text/plain"}

    # One node's scrape fits with room to spare; a bigger body is refused before it is read.
    scrape = _scrape("h100-1")
    assert 50_000 < len(scrape) < s.max_agent_telemetry_bytes // 4
    ok = client.post("/v1/agent/telemetry", content=scrape, headers=text)
    assert ok.status_code == 200, ok.text
    assert s.max_agent_telemetry_bytes < s.max_telemetry_bytes
    big = "#" * (s.max_agent_telemetry_bytes + 1)
    for body in (big, iter([big[: len(big) // 2].encode(), big[len(big) // 2 :].encode()])):
        r = client.post("/v1/agent/telemetry", content=body, headers=text)
        assert r.status_code == 413, r.text[:300]
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["code"] == "payload_too_large"

    # A batch of logs: the agent's largest (512 KiB of output) fits; past the cap, 413.
    out, wid = "x" * (256 * 1024), str(uuid.uuid4())
    fits = {"chunks": [log_chunk(wid, i * len(out), out) for i in range(2)]}
    assert client.post("/v1/agent/logs", json=fits, headers=auth(cred)).status_code == 200
    over = {"chunks": [log_chunk(wid, i * len(out), out) for i in range(9)]}
    r = client.post("/v1/agent/logs", json=over, headers=auth(cred))
    assert 9 * len(out) > s.max_agent_log_bytes
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text[:300]


# --- `process` work only where the operator trusts it --------------------------------------------

POOLED = """
regions:
  - name: r1
    racks:
      - name: shared
        kind: hgx
        gpu_model: H100-80GB
        pool: shared
        nodes:
          - {name: s-1, gpus: 4}
      - name: trusted
        kind: hgx
        gpu_model: H100-80GB
        pool: trusted
        nodes:
          - {name: t-1, gpus: 4}
"""


def test_process_work_runs_only_in_trusted_pools_and_where_its_runtime_is(
    client, world, session, monkeypatch
):
    """A node's agent says what it can run; the snapshot placement reads offers `process` only
    in the pools RACKPLANE_PROCESS_POOLS names (a tenant's bare process never lands beside
    another tenant's on a shared node), and follows a new inventory (the fleet version moves)."""
    from app.core.config import get_settings
    from app.models.fleet import Node
    from app.scheduling.world import world_of

    world.fleet(POOLED)
    op = world.key()
    for name in ("s-1", "t-1"):
        cred = join_node(client, op, name)
        inv = {
            **fake_inventory(name),
            "runtimes": ["process", "podman"],
            "capabilities": ["run-uids"],
        }
        assert bring_up(client, cred, inv).status_code == 200
    session.expire_all()
    offers = dict(session.execute(select(Node.name, Node.agent_offers)).all())
    assert offers == {"s-1": ["podman", "process", "run-uids"], "t-1": offers["t-1"]}

    monkeypatch.setenv("RACKPLANE_PROCESS_POOLS", "trusted")
    get_settings.cache_clear()
    try:
        seen = {s.name: s.runtimes for s in world_of(session, "r1").specs}
        assert seen == {"s-1": frozenset({"podman"}), "t-1": frozenset({"process", "podman"})}
        # The shared node's agent stops offering podman: the next snapshot knows at once.
        cred = join_node(client, op, "s-1")
        assert bring_up(client, cred, fake_inventory("s-1")).status_code == 200
        session.commit()
        seen = {s.name: s.runtimes for s in world_of(session, "r1").specs}
        assert seen["s-1"] == frozenset()
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
