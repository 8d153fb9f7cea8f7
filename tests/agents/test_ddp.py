"""Distributed training across hosts (issue 46): three hosts made of network namespaces on a
bridge (rackplane_bench/hosts.py), each with its own address and its own `rackplane agent`
started inside it, against a real API process and Celery worker on PostgreSQL and Redis. A
gang of four replicas (two per host) runs `examples/ddp_train.py`: real PyTorch
DistributedDataParallel over Gloo, its ranks meeting at rank 0's host across the bridge.

Rank 0's host is lost (every process in it SIGKILLed, its link cut): the survivors' Gloo errors
are not the workload's failure; the control plane notices, requeues the gang, which resumes from
its last checkpoint on the hosts left (the spare among them) with its loss where it was, and
ends `succeeded`; no replica's usage overlaps itself, and the lost host's end at the loss.

Needs root, iproute2 and `.venv-train` (torch 2.13.0, CPU): `make test` installs them
(`make train-engines`); without them the module is skipped, saying why."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.cli import cli
from rackplane_bench import hosts as netns
from tests.fixtures.harness import ROOT
from tests.fixtures.nodes import Nodes, join_tokens
from tests.fixtures.plane import plane as control_plane
from tests.fixtures.world import auth, wait_until

TRAIN_PY = ROOT / ".venv-train" / "bin" / "python"
DDP = str(ROOT / "examples" / "ddp_train.py")
HEARTBEAT_TIMEOUT = 6.0
NODES = ["ddp-a", "ddp-b", "ddp-c"]
FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-ddp
        kind: hgx
        gpu_model: H100-80GB
        nodes:
          - {name: ddp-a, gpus: 4}
          - {name: ddp-b, gpus: 4}
          - {name: ddp-c, gpus: 4}
"""

pytestmark = pytest.mark.skipif(
    bool(netns.available()) or not TRAIN_PY.exists(),
    reason=netns.available() or "no .venv-train with torch (make train-engines)",
)


@pytest.fixture(scope="module")
def hosts():
    h = netns.Hosts.make(len(NODES))
    yield h
    h.remove()


@pytest.fixture(scope="module")
def plane(database, hosts, tmp_path_factory):
    """The API listens on the bridge (where the hosts reach it); silence is a fault after a
    few seconds."""
    env = {
        **os.environ,
        "RACKPLANE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
        "RACKPLANE_AGENT_START_TIMEOUT": "90",
        "RACKPLANE_HEALTH_SWEEP": "2",
    }
    with control_plane(tmp_path_factory.mktemp("ddp"), env, "ddp", host=hosts.gateway) as url:
        yield url


@pytest.fixture
def agents(plane, hosts, world, client, tmp_path):
    """Each host's agent, started inside its namespace with its address; at the end every
    agent and run gone and every host's link up again (the next test's hosts)."""
    world.fleet(FLEET)
    op = world.key()
    env = {**os.environ, "RACKPLANE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT)}

    def launch(node: str, argv: list[str], **popen) -> subprocess.Popen:
        return hosts.popen(NODES.index(node), argv, **popen)

    a = Nodes(plane, tmp_path, join_tokens(client, op), env, launch)
    for i, node in enumerate(NODES):
        a.start(node, hosts.address(i), args=["--data-interface", "eth0"])
    a.wait_ready(op)
    http = httpx.Client(base_url=plane, timeout=10)
    yield a, http
    for i in range(len(NODES)):
        hosts.lose(i)
        hosts.restore(i)
    a.stop()
    http.close()


def _lose(a: Nodes, hosts: netns.Hosts, node: str) -> datetime:
    """The host gone at once, as a power cut would take it: its link down, everything on it
    killed."""
    at = datetime.now(UTC)
    hosts.lose(NODES.index(node))
    a.procs.pop(node).wait(timeout=10)
    return at


def _get(http, key, wid) -> dict:
    return http.get(f"/v1/workloads/{wid}", headers=auth(key)).json()


def _logs(http, key, wid, replica: int) -> str:
    r = http.get(
        f"/v1/workloads/{wid}/logs", params={"limit": 1000, "replica": replica}, headers=auth(key)
    )
    assert r.status_code == 200, r.text
    return "".join(c["data"] for c in r.json()["items"])


def _usage_spans(session, wid: str) -> list[tuple]:
    """Each allocation's usage as (start, stop), in order: every one started and stopped once."""
    from app.models.metering import UsageEvent

    session.expire_all()
    rows = session.execute(
        select(UsageEvent.kind, UsageEvent.occurred_at, UsageEvent.allocation_id)
        .where(UsageEvent.workload_id == uuid.UUID(wid))
        .order_by(UsageEvent.occurred_at)
    ).all()
    spans: dict[uuid.UUID, list] = defaultdict(list)
    for kind, at, alloc in rows:
        spans[alloc].append((kind, at))
    assert all([k for k, _ in s] == ["start", "stop"] for s in spans.values()), rows
    return sorted((s[0][1], s[1][1]) for s in spans.values())


def _events(http, key, wid) -> list[dict]:
    return http.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]


def test_a_gang_across_hosts_trains_loses_a_host_and_resumes_from_its_checkpoint(
    agents, hosts, world, session
):
    a, http = agents
    key = world.key(world.tenant("ddp"))
    steps = 140
    command = [str(TRAIN_PY), "-u", DDP, "--steps", str(steps), "--step-seconds", "0.25"]
    command += ["--checkpoint-every", "20", "--checkpoint-dir", str(a.ckpt())]
    made = http.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 2, "replicas": 4, "command": command},
        headers=auth(key),
    )
    assert made.status_code == 201, made.text
    wid = made.json()["id"]
    wait_until(lambda: _get(http, key, wid)["state"] == "running", timeout=120)
    placement = _get(http, key, wid)["placement"]
    by_replica = {p["replica"]: p["node"] for p in placement}
    assert len(set(by_replica.values())) == 2, placement  # two hosts, two replicas each
    master = hosts.address(NODES.index(by_replica[0]))

    # Every rank met at rank 0's host, across the bridge, and trains: one world of four.
    try:
        wait_until(lambda: "step 3/" in _logs(http, key, wid, 0), timeout=120)
    except AssertionError:
        raise AssertionError([_logs(http, key, wid, r)[:2500] for r in range(4)]) from None
    for r in range(4):
        start = re.search(
            r"^start rank=(\d) world=(\d) backend=gloo .* master=(\S+):(\d+)",
            _logs(http, key, wid, r),
            re.M,
        )
        assert start and start.groups()[:3] == (str(r), "4", master), _logs(http, key, wid, r)
    port = int(start.group(4))
    assert 20000 <= port <= 29999

    # A checkpoint is reported, then rank 0's host is lost with everything on it.
    wait_until(lambda: (_get(http, key, wid)["last_checkpoint_step"] or 0) >= 20, timeout=120)
    lost_node = by_replica[0]
    killed_at = _lose(a, hosts, lost_node)

    # Requeued, placed on the hosts left (the spare among them), resumed from its checkpoint.
    wait_until(lambda: _get(http, key, wid)["attempts"] >= 2, timeout=90)
    again = _get(http, key, wid)["placement"]
    assert lost_node not in {p["node"] for p in again}, again
    done = wait_until(
        lambda: (w := _get(http, key, wid))["state"] in ("succeeded", "failed") and w, timeout=240
    )
    events = _events(http, key, wid)
    trail = " | ".join(f"{e['kind']} {e['to_state']} {e['reason']}" for e in events)
    assert done["state"] == "succeeded", trail
    # The survivors' Gloo errors were not the workload's failure: a host fault interrupted it.
    assert not any(e["to_state"] == "failed" for e in events), trail
    interrupted = [
        e for e in events if e["from_state"] == "running" and e["to_state"] == "preempted"
    ]
    assert len(interrupted) == 1 and "fault" in interrupted[0]["reason"], trail
    assert done["interruptions"] == 1

    # The step goes on from the checkpoint, and the loss with it (within the run's noise).
    requeue = next(e for e in events if e["to_state"] == "queued" and e["from_state"] != "pending")
    step = requeue["details"]["checkpoint_step"]
    assert step >= 20, requeue
    out = _logs(http, key, wid, 0)
    # (The checkpoint holds its loss; the resumed rank 0 prints it.)
    saved = float(re.search(rf"resumed from step {step} loss=([0-9.]+)", out).group(1))
    after = out.split(f"resumed from step {step}")[1]
    first = float(re.search(rf"step {step + 1}/{steps} loss=([0-9.]+) world=4", after).group(1))
    initial = float(re.search(rf"step 1/{steps} loss=([0-9.]+)", out).group(1))
    assert first < 2 * saved + 0.02 and first < initial / 3, (saved, first, initial)
    assert f"step {steps}/{steps}" in out

    # Usage: no replica's intervals overlap; the lost host's end at the loss (its last report).
    intervals = _usage_spans(session, wid)
    assert len(intervals) == 8, intervals  # four replicas, two attempts
    first_run = intervals[:4]
    assert all(stop <= killed_at + timedelta(seconds=1) for _, stop in first_run), first_run
    assert max(stop for _, stop in first_run) <= min(start for start, _ in intervals[4:])


def test_an_elastic_gang_goes_on_with_the_host_left_and_grows_back_at_a_checkpoint(
    agents, hosts, world, client, session
):
    """`elastic: {min_replicas: 2}`: on the loss of one of its two hosts it goes on at once on
    the other with WORLD_SIZE 2 (a new attempt, from its checkpoint), and once capacity is back
    (the spare host returned to service) it grows back to four at its next checkpoint."""
    a, http = agents
    op = auth(world.key())
    nodes = {n["name"]: n["id"] for n in client.get("/v1/admin/nodes", headers=op).json()["items"]}
    spare = NODES[2]
    cordon = client.patch(f"/v1/admin/nodes/{nodes[spare]}", json={"state": "cordoned"}, headers=op)
    assert cordon.status_code == 200, cordon.text
    key = world.key(world.tenant("elastic"))
    steps = 200
    command = [str(TRAIN_PY), "-u", DDP, "--steps", str(steps), "--step-seconds", "0.2"]
    command += ["--checkpoint-every", "20", "--checkpoint-dir", str(a.ckpt())]
    made = http.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 2,
            "replicas": 4,
            "elastic": {"min_replicas": 2},
            "command": command,
        },
        headers=auth(key),
    )
    assert made.status_code == 201, made.text
    assert made.json()["elastic"] == {"min_replicas": 2, "current_replicas": 4}
    wid = made.json()["id"]
    wait_until(lambda: _get(http, key, wid)["state"] == "running", timeout=120)
    by_replica = {p["replica"]: p["node"] for p in _get(http, key, wid)["placement"]}
    assert spare not in by_replica.values()
    wait_until(lambda: (_get(http, key, wid)["last_checkpoint_step"] or 0) >= 20, timeout=120)
    lost = by_replica[0]
    killed_at = _lose(a, hosts, lost)

    # At once on the host left: two replicas, WORLD_SIZE 2, from the checkpoint.
    wait_until(lambda: _get(http, key, wid)["attempts"] >= 2, timeout=90)
    shrunk = _get(http, key, wid)
    assert shrunk["elastic"] == {"min_replicas": 2, "current_replicas": 2}, shrunk
    assert {p["node"] for p in shrunk["placement"]} <= set(NODES) - {lost, spare}
    assert len(shrunk["placement"]) == 2
    gql = client.post(
        "/graphql",
        json={
            "query": "query($id: ID!) { workload(id: $id) { "
            "elastic { minReplicas currentReplicas } } }",
            "variables": {"id": wid},
        },
        headers=auth(key),
    ).json()
    assert gql["data"]["workload"]["elastic"] == {"minReplicas": 2, "currentReplicas": 2}, gql
    shown = CliRunner().invoke(cli, ["workloads", "show", wid])
    assert "2 of 4 replicas now (goes on with at least 2)" in shown.output, shown.output
    wait_until(lambda: re.search(r"step \d+/\d+ loss=\S+ world=2", _logs(http, key, wid, 0)), 90)

    # Capacity returns: at its next checkpoint it grows back to four, on the spare and the
    # host it kept.
    back = client.patch(f"/v1/admin/nodes/{nodes[spare]}", json={"state": "ready"}, headers=op)
    assert back.status_code == 200, back.text
    wait_until(lambda: _get(http, key, wid)["attempts"] >= 3, timeout=120)
    grown = _get(http, key, wid)
    assert grown["elastic"]["current_replicas"] == 4 and len(grown["placement"]) == 4, grown
    done = wait_until(
        lambda: (w := _get(http, key, wid))["state"] in ("succeeded", "failed") and w, timeout=300
    )
    events = _events(http, key, wid)
    trail = " | ".join(f"{e['kind']} {e['to_state']} {e['reason']}" for e in events)
    assert done["state"] == "succeeded", trail
    elastic = [e["details"] for e in events if e["kind"] == "elastic"]
    assert [(d["from"], d["to"]) for d in elastic] == [(4, 2), (2, 4)], trail
    out = _logs(http, key, wid, 0)
    assert re.search(rf"step {steps}/{steps} loss=\S+ world=4", out), out[-2000:]

    # Usage: each attempt's allocations end before the next one's begin; the lost host's at
    # the loss. Four, then two, then four.
    intervals = _usage_spans(session, wid)
    assert len(intervals) == 10, intervals
    runs = [intervals[:4], intervals[4:6], intervals[6:]]
    assert all(stop <= killed_at + timedelta(seconds=1) for _, stop in runs[0]), runs[0]
    for before, after in zip(runs, runs[1:], strict=False):
        assert max(stop for _, stop in before) <= min(start for start, _ in after)
