"""The control plane's side of node agents: inventory against the fleet's record, the node's
desired state as a blocking query, and run reports that start, end and fail workloads. The
agent here is the test itself, speaking the wire (tests/agent and test_agent_e2e run the real
program)."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from app.core.db import as_aware
from tests.fixtures.agent_api import AGENT_FLEET, bring_up, fake_gpus, fake_inventory, join_node
from tests.fixtures.world import auth, wait_until


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _state(client, key, wid) -> str:
    return client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"]


def test_inventory_assignments_and_reports_drive_a_gang(
    client, world, session, celery_worker_process
):
    from app.models.fleet import Gpu, Node
    from app.models.metering import UsageEvent

    world.fleet(AGENT_FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    creds = {n: join_node(client, op, n) for n in ("a-1", "a-2")}

    # Before its inventory a node has nothing to run, and says so at once.
    first = client.get("/v1/agent/assignments", params={"wait": "1s"}, headers=auth(creds["a-1"]))
    assert first.status_code == 200, first.text
    assert (first.json()["index"], first.json()["assignments"]) == (0, [])

    # An inventory that differs is named, and the node takes no new work until one matches.
    wrong = fake_gpus("a-2", 3) + [{"index": 3, "uuid": "GPU-x", "model": "A100-80GB"}]
    verdict = client.put(
        "/v1/agent/inventory", json=fake_inventory("a-2", wrong), headers=auth(creds["a-2"])
    )
    assert verdict.status_code == 200, verdict.text
    v = verdict.json()
    assert not v["matches"] and v["node_state"] == "validating"
    assert v["differences"] == ["GPU 3 is a A100-80GB, the fleet records a H100-80GB"]
    session.expire_all()
    node = session.scalar(select(Node).where(Node.name == "a-2"))
    assert node.state == "validating" and "GPU 3 is a A100-80GB" in node.state_reason
    for n in ("a-1", "a-2"):
        ok = bring_up(client, creds[n], fake_inventory(n))
        assert ok.json() == {
            "node": n,
            "matches": True,
            "differences": [],
            "node_state": "ready",
        }, ok.text
    session.expire_all()
    assert (
        session.scalar(select(Gpu.uuid).where(Gpu.index == 2, Gpu.node_id == node.id))
        == "GPU-a-2-0002"
    )

    # Bad fields are named; the agent's own variables are not the workload's to set.
    bad = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 2,
            "replicas": 2,
            "command": ["x"],
            "env": {"RACKPLANE_TOKEN": "x"},
        },
        headers=auth(key),
    )
    assert bad.status_code == 422 and "RACKPLANE_TOKEN" in bad.text
    # A container takes its env as `NAME=value` lines: a line break in a value is refused.
    bad = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 1,
            "runtime": "podman",
            "image": "img",
            "command": ["x"],
            "env": {"PEM": "a\nb"},
        },
        headers=auth(key),
    )
    assert bad.status_code == 422 and "PEM" in bad.text and "line break" in bad.text

    # An agent waiting on its index is answered when the gang lands on its node.
    idx = client.get("/v1/agent/assignments", headers=auth(creds["a-1"])).json()["index"]
    answered: dict = {}

    def wait() -> None:
        t0 = time.monotonic()
        r = client.get(
            "/v1/agent/assignments",
            params={"index": idx, "wait": "60s"},
            headers=auth(creds["a-1"]),
        )
        answered.update(r.json(), took=time.monotonic() - t0)

    waiter = threading.Thread(target=wait)
    waiter.start()
    # Two replicas of 4 GPUs: one on each node, a-1 among them (with 2 GPUs each the gang may
    # land on a-2 alone, and a-1's wait was never answered).
    made = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 4,
            "replicas": 2,
            "command": ["python", "train.py", "--steps", "10"],
            "env": {"LR": "0.1"},
            "checkpoint": {"signal": "SIGUSR2"},
        },
        headers=auth(key),
    )
    assert made.status_code == 201, made.text
    wid = made.json()["id"]
    assert (made.json()["command"], made.json()["env"]) == (
        ["python", "train.py", "--steps", "10"],
        {"LR": "0.1"},
    )
    # Answered by the change, not by the wait's end (bounds for a busy machine).
    waiter.join(70)
    assert answered["index"] > idx and answered["took"] < 55, (answered, idx)
    wait_until(lambda: _state(client, key, wid) == "provisioning", timeout=20)

    runs = {}
    for n in ("a-1", "a-2"):
        a = client.get("/v1/agent/assignments", headers=auth(creds[n])).json()["assignments"]
        runs.update({x["replica"]: (n, x) for x in a})
    assert sorted(runs) == [0, 1]
    envs = [runs[r][1]["env"] for r in (0, 1)]
    devices = [set(e["CUDA_VISIBLE_DEVICES"].split(",")) for e in envs]
    assert all(len(d) == 4 for d in devices) and not devices[0] & devices[1]
    assert all(d.startswith("GPU-") for ds in devices for d in ds)
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == f"{runs[0][0]}.test"
    # What torchrun's workers expect (issue 46 §2): one process per replica, a node each.
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert 20000 <= int(envs[0]["MASTER_PORT"]) <= 29999
    assert [(e["GROUP_RANK"], e["LOCAL_WORLD_SIZE"], e["ROLE_RANK"]) for e in envs] == [
        ("0", "1", "0"),
        ("1", "1", "1"),
    ]
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {wid}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {str(runs[0][1]["attempt"])}
    assert envs[0]["NVIDIA_VISIBLE_DEVICES"] == envs[0]["CUDA_VISIBLE_DEVICES"]
    assert runs[0][1]["checkpoint_signal"] == "SIGUSR2" and runs[0][1]["desired"] == "run"
    # The node's whole desired state carries no secret: the workload's env and its token are
    # fetched per run, by the node that holds it, before it starts.
    assert all(runs[r][1]["fetch_env"] for r in (0, 1))
    assert not {"LR", "RACKPLANE_TOKEN"} & (set(envs[0]) | set(envs[1]))

    def run_env(replica: int, node: str | None = None, attempt: int | None = None):
        holder, a = runs[replica]
        at = a["attempt"] if attempt is None else attempt
        return client.get(
            f"/v1/agent/runs/{wid}/{at}/{replica}/env", headers=auth(creds[node or holder])
        )

    secret = run_env(0)
    assert secret.status_code == 200, secret.text
    assert secret.json()["env"]["LR"] == "0.1"
    token = secret.json()["env"]["RACKPLANE_TOKEN"]
    # Not for a node that does not hold the run, nor for another attempt.
    node0 = runs[0][0]
    for refused in (
        run_env(0, node="a-2" if node0 == "a-1" else "a-1"),
        run_env(0, attempt=runs[0][1]["attempt"] + 1),
    ):
        assert refused.status_code == 409 and refused.json()["code"] == "run_not_startable"

    def report(replica: int, **run) -> dict:
        node, a = runs[replica]
        body = {
            "runs": [
                {
                    "workload_id": wid,
                    "attempt": a["attempt"],
                    "replica": replica,
                    "at": _now(),
                    **run,
                }
            ]
        }
        r = client.post("/v1/agent/status", json=body, headers=auth(creds[node]))
        assert r.status_code == 200, r.text
        return r.json()

    # One replica up is not the run; both are. A repeated report changes nothing.
    assert report(0, state="running", pid=100) == {"accepted": 1, "stale": 0}
    time.sleep(1)
    assert _state(client, key, wid) == "provisioning"
    report(1, state="running", pid=101)
    report(1, state="running", pid=101)
    wait_until(lambda: _state(client, key, wid) == "running", timeout=10)
    # Once a run has started, its node's credential no longer reads its secrets.
    late = run_env(0)
    assert late.status_code == 409 and late.json()["code"] == "run_not_startable", late.text

    # A report about another attempt, or from the wrong node, is stale.
    node0, a0 = runs[0]
    other = "a-2" if node0 == "a-1" else "a-1"
    stale = client.post(
        "/v1/agent/status",
        json={
            "runs": [
                {
                    "workload_id": wid,
                    "attempt": a0["attempt"],
                    "replica": 0,
                    "at": _now(),
                    "state": "exited",
                    "exit_code": 1,
                }
            ]
        },
        headers=auth(creds[other]),
    )
    assert stale.json() == {"accepted": 0, "stale": 1}

    # The run's own token reports its checkpoint (with a location); it is no key for anything else.
    ck = client.post(
        f"/v1/workloads/{wid}/checkpoints",
        json={"size_bytes": 1024, "uri": "file:///ckpt/step-5.json", "step": 5},
        headers=auth(token),
    )
    assert ck.status_code == 201, ck.text
    assert client.get("/v1/workloads", headers=auth(token)).status_code == 401
    other_w = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)
    ).json()["id"]
    refused = client.post(
        f"/v1/workloads/{other_w}/checkpoints", json={"size_bytes": 1}, headers=auth(token)
    )
    assert refused.status_code == 401 and refused.json()["code"] == "invalid_workload_token"

    # A checkpoint asked for: the runs' nodes are told (a new index), once per request.
    node0 = runs[0][0]
    before = client.get("/v1/agent/assignments", headers=auth(creds[node0])).json()
    asked = client.post(f"/v1/workloads/{wid}/checkpoint-requests", headers=auth(key))
    assert asked.status_code == 202, asked.text
    after = client.get(
        "/v1/agent/assignments",
        params={"index": before["index"], "wait": "5s"},
        headers=auth(creds[node0]),
    ).json()
    assert after["index"] > before["index"]
    mine = [x for x in after["assignments"] if x["workload_id"] == wid]
    assert mine and all(x["checkpoint_requests"] == 1 for x in mine)
    queued = client.post(f"/v1/workloads/{other_w}/checkpoint-requests", headers=auth(key))
    assert queued.status_code == 409 and queued.json()["code"] == "workload_not_running"
    # The same through GraphQL (one service function, one error code).
    ask = """mutation($id: ID!) { requestCheckpoint(id: $id) {
        __typename ... on Workload { id } ... on Problem { code } } }"""

    def gql_ask(workload_id):
        r = client.post(
            "/graphql", json={"query": ask, "variables": {"id": workload_id}}, headers=auth(key)
        )
        assert r.status_code == 200, r.text
        return r.json()["data"]["requestCheckpoint"]

    assert gql_ask(other_w) == {"__typename": "ConflictProblem", "code": "workload_not_running"}
    assert gql_ask(wid)["__typename"] == "Workload"
    again = client.get(
        "/v1/agent/assignments",
        params={"index": after["index"], "wait": "5s"},
        headers=auth(creds[node0]),
    ).json()
    assert again["index"] > after["index"]
    mine = [x for x in again["assignments"] if x["workload_id"] == wid]
    assert mine and all(x["checkpoint_requests"] == 2 for x in mine)

    # A non-zero exit fails the workload with its code and last lines; usage ends at the exit.
    exit_at = datetime.now(UTC)
    body = {
        "runs": [
            {
                "workload_id": wid,
                "attempt": runs[1][1]["attempt"],
                "replica": 1,
                "at": exit_at.isoformat(),
                "state": "exited",
                "exit_code": 3,
                "tail": ["step 7/10", "Traceback: boom"],
            }
        ]
    }
    client.post("/v1/agent/status", json=body, headers=auth(creds[runs[1][0]]))
    # Replica 0's host has not spoken since: its loss would be no fault of the workload's, so
    # the failure waits for it (issue 46 §3).
    time.sleep(0.5)
    assert _state(client, key, wid) == "running"
    events = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
    assert events[-1]["kind"] == "judging" and "replica 1" in events[-1]["reason"], events[-1]
    # Its replica exits too (its peer is gone): every host has spoken, the failure stands.
    body["runs"][0].update(replica=0, attempt=runs[0][1]["attempt"], exit_code=1, tail=["lost"])
    body["runs"][0]["at"] = (exit_at + timedelta(seconds=0.5)).isoformat()
    client.post("/v1/agent/status", json=body, headers=auth(creds[node0]))
    wait_until(lambda: _state(client, key, wid) == "failed", timeout=10)
    ev = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"][-1]
    assert ev["to_state"] == "failed" and ev["details"]["exit_code"] == 3
    assert ev["details"]["tail"][-1] == "Traceback: boom" and "replica 1" in ev["reason"]
    session.expire_all()
    stops = session.scalars(
        select(UsageEvent.occurred_at).where(
            UsageEvent.workload_id == uuid.UUID(wid), UsageEvent.kind == "stop"
        )
    ).all()
    assert stops and all(
        abs((s.replace(tzinfo=UTC) if s.tzinfo is None else s) - exit_at).total_seconds() < 0.01
        for s in stops
    )

    # Its runs leave the nodes' desired state: the agents stop them.
    left = client.get("/v1/agent/assignments", headers=auth(creds["a-1"])).json()["assignments"]
    assert all(x["workload_id"] != wid for x in left)

    # A job array's elements each run with their own index (issue 45 item 14).
    made = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 2, "command": ["sweep"], "array": {"count": 2}},
        headers=auth(key),
    )
    assert made.status_code == 201, made.text
    array_id = made.json()["array"]["id"]

    def indices() -> list[tuple[str, str, str]]:
        got = []
        for n in ("a-1", "a-2"):
            a = client.get("/v1/agent/assignments", headers=auth(creds[n])).json()["assignments"]
            got += [
                (x["env"]["RACKPLANE_ARRAY_INDEX"], x["env"]["RACKPLANE_ARRAY_COUNT"],
                 x["env"]["RACKPLANE_ARRAY_ID"])
                for x in a if "RACKPLANE_ARRAY_INDEX" in x["env"]
            ]  # fmt: skip
        return sorted(got)

    assert wait_until(lambda: len(indices()) == 2, timeout=30)
    assert indices() == [("0", "2", array_id), ("1", "2", array_id)]


def test_an_agent_pushes_telemetry_for_its_own_node_only(client, world, session):
    from app.models.health import NodeHeartbeat

    world.fleet(AGENT_FLEET)
    op = world.key()
    cred = join_node(client, op, "a-1")
    assert bring_up(client, cred, fake_inventory("a-1")).json()["matches"]
    text = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a-1-0000",Hostname="a-1"} 61\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-a-2-0001",Hostname="a-2"} 62\n'
        'DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a-1-0002"} 63\n'
    )
    r = client.post(
        "/v1/agent/telemetry",
        content=text,
        headers={**auth(cred), "content-type": "text/plain; version=0.0.4"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    # Its own GPUs (by hostname, or by UUID alone); another node's sample is refused.
    assert body["accepted"] == 2 and body["rejected"] == 1, body
    assert (
        client.post(
            "/v1/agent/telemetry", content="not prometheus {", headers=auth(cred)
        ).status_code
        == 422
    )
    tenant = world.key(world.tenant("acme"))
    assert client.post("/v1/agent/telemetry", content=text, headers=auth(tenant)).status_code == 401
    session.expire_all()
    assert session.scalar(select(NodeHeartbeat.agent))  # the agent is known: silence is a fault


def test_a_command_that_cannot_start_fails_at_once_and_bills_only_what_ran(
    client, world, session, celery_worker_process
):
    """Issue 45 item 2: `/no/such/binary` went round provisioning -> queued 47 times, billed,
    never failed. A start failure that is the workload's own (the agent says `fault:
    workload`) fails it at once with the reason; one that is the node's puts it back in the
    queue, as before. A replica that never ran is never billed; one whose process ran is."""
    from app.models.metering import UsageEvent
    from app.models.workloads import Allocation

    world.fleet(AGENT_FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    creds = {n: join_node(client, op, n) for n in ("a-1", "a-2")}
    for n in creds:
        bring_up(client, creds[n], fake_inventory(n))

    def submit() -> str:
        made = client.post(
            "/v1/workloads",
            json={"kind": "job", "gpus": 4, "replicas": 2, "command": ["/no/such/binary"]},
            headers=auth(key),
        )
        assert made.status_code == 201, made.text
        wid = made.json()["id"]
        wait_until(lambda: _state(client, key, wid) == "provisioning", timeout=20)
        return wid

    def report(wid: str, replica: int, **run) -> None:
        for node, cred in creds.items():
            mine = client.get("/v1/agent/assignments", headers=auth(cred)).json()["assignments"]
            for a in mine:
                if a["workload_id"] == wid and a["replica"] == replica:
                    body = {
                        "runs": [
                            {
                                "workload_id": wid,
                                "attempt": a["attempt"],
                                "replica": replica,
                                "at": _now(),
                                **run,
                            }
                        ]
                    }
                    r = client.post("/v1/agent/status", json=body, headers=auth(cred))
                    assert r.json() == {"accepted": 1, "stale": 0}, (node, r.text)
                    return
        raise AssertionError(f"replica {replica} of {wid} is on no node")

    # The node's fault (no message of the workload's): back in the queue.
    wid = submit()
    report(wid, 0, state="failed_to_start", message="no free SSH port on this node")

    def requeued() -> bool:
        events = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
        return any(
            e["to_state"] == "queued" and "provisioning failed" in e["reason"] for e in events
        )

    wait_until(requeued, timeout=15)
    client.delete(f"/v1/workloads/{wid}", headers=auth(key))

    # The workload's own: failed now, with why, its other replica stopped, nothing billed.
    wid = submit()
    report(wid, 1, state="running", pid=7)
    message = "command not found or not executable: /no/such/binary"
    report(wid, 0, state="failed_to_start", message=message, fault="workload")
    assert _state(client, key, wid) == "failed"
    ev = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"][-1]
    assert ev["to_state"] == "failed" and ev["from_state"] == "provisioning"
    assert ev["reason"] == f"replica 0 could not start: {message}"
    assert ev["details"] == {"cause": "failed_to_start", "replica": 0, "message": message}
    session.expire_all()
    usage = session.execute(
        select(UsageEvent.allocation_id, UsageEvent.kind, UsageEvent.occurred_at).where(
            UsageEvent.workload_id == uuid.UUID(wid)
        )
    ).all()
    spans: dict = {}
    for alloc, kind, at in usage:
        spans.setdefault(alloc, {})[kind] = at
    replica = dict(
        session.execute(
            select(Allocation.id, Allocation.replica).where(
                Allocation.workload_id == uuid.UUID(wid)
            )
        ).all()
    )
    # Replica 0 never ran: nothing billed. Replica 1's process did run until it was stopped.
    by_replica = {replica[a]: s for a, s in spans.items()}
    assert by_replica[0]["stop"] == by_replica[0]["start"], usage
    assert by_replica[1]["stop"] > by_replica[1]["start"], usage
    for cred in creds.values():
        left = client.get("/v1/agent/assignments", headers=auth(cred)).json()["assignments"]
        assert all(x["workload_id"] != wid for x in left)

    # A process that started and crashed before its gang's other replica came up: the
    # workload's own failure (the default policy does not restart it), never requeued as
    # infrastructure; its GPUs are billed until the crash, not zero.
    wid = submit()
    crash = datetime.now(UTC)
    report(wid, 0, state="exited", exit_code=3, at=crash.isoformat(), tail=["Traceback"])
    assert _state(client, key, wid) == "failed"
    events = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
    assert not any(e["from_state"] == "provisioning" and e["to_state"] == "queued" for e in events)
    ev = events[-1]
    assert ev["from_state"] == "running" and "exited (code 3)" in ev["reason"], ev
    assert ev["details"]["cause"] == "exited_nonzero" and ev["details"]["tail"] == ["Traceback"]
    session.expire_all()
    usage = session.execute(
        select(UsageEvent.allocation_id, UsageEvent.kind, UsageEvent.occurred_at).where(
            UsageEvent.workload_id == uuid.UUID(wid)
        )
    ).all()
    spans = {}
    for alloc, kind, at in usage:
        spans.setdefault(alloc, {})[kind] = at
    assert len(spans) == 2, usage
    for s in spans.values():
        assert s["start"] < s["stop"] and abs(as_aware(s["stop"]) - crash) < timedelta(seconds=1)


def test_a_checkpoint_written_in_the_grace_of_a_terminate_counts(client, world, session):
    """Issue 45 item 5: the workload token died at terminate, so the final checkpoint a run
    writes in its grace (SIGTERM, then SIGKILL 30 s later) was refused with 401. It counts
    while the run may still be in its grace, and not after."""
    from app.models.workloads import Workload
    from app.tenancy.run_tokens import STOP_GRACE_S

    world.fleet(AGENT_FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    cred = join_node(client, op, "a-1")
    bring_up(client, cred, fake_inventory("a-1"))
    made = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 4, "command": ["python", "train.py"], "region": "r1"},
        headers=auth(key),
    )
    assert made.status_code == 201, made.text
    wid = made.json()["id"]
    wait_until(lambda: _state(client, key, wid) == "provisioning", timeout=20)
    a = client.get("/v1/agent/assignments", headers=auth(cred)).json()["assignments"][0]
    env = client.get(f"/v1/agent/runs/{wid}/{a['attempt']}/0/env", headers=auth(cred)).json()
    token = env["env"]["RACKPLANE_TOKEN"]
    run = {"workload_id": wid, "attempt": a["attempt"], "replica": 0, "at": _now()}
    client.post(
        "/v1/agent/status",
        json={"runs": [{**run, "state": "running", "pid": 9}]},
        headers=auth(cred),
    )
    wait_until(lambda: _state(client, key, wid) == "running", timeout=10)

    def checkpoint(step: int, who: str):
        body = {"size_bytes": 1, "step": step, "uri": f"file:///ckpt/step-{step}"}
        return client.post(f"/v1/workloads/{wid}/checkpoints", json=body, headers=auth(who))

    assert checkpoint(5, token).status_code == 201
    assert client.delete(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "terminated"
    # In its grace: the run's SIGTERM handler writes step 6 and reports it with its token.
    last = checkpoint(6, token)
    assert last.status_code == 201, last.text
    got = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
    assert (got["last_checkpoint_step"], got["last_checkpoint_uri"]) == (6, "file:///ckpt/step-6")
    # Past the grace (and the report's slack), the token is dead and nothing is taken.
    w = session.get(Workload, uuid.UUID(wid))
    w.finished_at = w.finished_at - timedelta(seconds=STOP_GRACE_S + 10)
    session.commit()
    late = checkpoint(7, token)
    assert late.status_code == 401 and late.json()["code"] == "invalid_workload_token"
    by_key = checkpoint(7, key)
    assert by_key.status_code == 409 and by_key.json()["code"] == "workload_not_running"


def test_a_restart_policy_restarts_failures_backs_off_and_stops_at_its_limit(
    client, world, session, celery_worker_process
):
    """Issue 45 item 3: nothing capped automatic restarts. A job whose policy restarts it
    after its own failure runs again from the queue, the second restart waits its back-off,
    and the next failure past `max_restarts` fails it, saying why. A loss that is the agent's
    own failure restarts it too, as infrastructure, never counted as a hardware fault."""
    world.fleet(AGENT_FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    cred = join_node(client, op, "a-1")
    bring_up(client, cred, fake_inventory("a-1"))
    policy = {
        "on": ["failure", "infrastructure", "preemption"],
        "max_restarts": 2,
        "backoff_s": 3,
        "backoff_max_s": 3,
    }
    made = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 4,
            "region": "r1",
            "command": ["sh", "-c", "exit 3"],
            "restart_policy": policy,
        },
        headers=auth(key),
    )
    assert made.status_code == 201, made.text
    wid = made.json()["id"]
    assert made.json()["restart_policy"] == {**policy, "counts": ["failure", "infrastructure"]}
    assert made.json()["restarts"] == {}

    def doc() -> dict:
        return client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()

    def events() -> list[dict]:
        return client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]

    def run_and_fail(attempt: int) -> None:
        wait_until(
            lambda: (d := doc())["state"] == "provisioning" and d["attempts"] == attempt,
            timeout=60,
        )
        run = {"workload_id": wid, "attempt": attempt, "replica": 0}
        for body in (
            {**run, "state": "running", "pid": 9, "at": _now()},
            {**run, "state": "exited", "exit_code": 3, "at": _now(), "tail": ["boom"]},
        ):
            r = client.post("/v1/agent/status", json={"runs": [body]}, headers=auth(cred))
            assert r.json() == {"accepted": 1, "stale": 0}, r.text

    run_and_fail(1)
    back = next(e for e in reversed(events()) if e["from_state"] == "running")
    assert back["to_state"] == "queued"
    assert "exited (code 3)" in back["reason"] and "restart 1 of 2 (failure)" in back["reason"]
    assert back["details"]["restart"]["restart_number"] == 1

    run_and_fail(2)  # the second restart backs off
    got = doc()
    back = next(e for e in reversed(events()) if e["from_state"] == "running")
    assert "restart 2 of 2 (failure), in 3 s" in back["reason"], back
    assert got["state"] == "queued" and got["not_before"] is not None, got
    not_before = datetime.fromisoformat(got["not_before"])
    assert got["restarts"] == {"failure": 2}
    # Why it waits, as the cycle after its requeue saw it (issue 45 item 12).
    waits = wait_until(lambda: doc()["pending"] or datetime.now(UTC) > not_before, timeout=10)
    if datetime.now(UTC) < not_before:  # a busy machine may have passed the moment by
        assert waits["reason"] == "BackOff" and "until" in waits["detail"], waits

    run_and_fail(3)  # placed no sooner than its back-off allowed
    placed = [e for e in events() if e["to_state"] == "placing"]
    assert datetime.fromisoformat(placed[-1]["at"]) >= not_before - timedelta(seconds=0.01)
    wait_until(lambda: doc()["state"] == "failed", timeout=15)
    last = events()[-1]
    assert last["from_state"] == "running" and last["to_state"] == "failed"
    assert "restart limit reached: 2 of 2 restarts spent (failure 2)" in last["reason"]
    assert last["details"]["restart"]["why"] == "restart_limit_reached"
    # Its audit trail says the same: two requeues, then a failure, never a third "requeue".
    from app.models.audit import AuditEntry

    session.expire_all()
    trail = session.scalars(
        select(AuditEntry.action)
        .where(AuditEntry.target_id == wid, AuditEntry.principal == "system")
        .order_by(AuditEntry.created_at)
    ).all()
    assert trail == ["workload.requeue", "workload.requeue", "workload.fail"], trail
    gql = client.post(
        "/graphql",
        json={"query": f'{{ workload(id: "{wid}") {{ restartPolicy restarts notBefore }} }}'},
        headers=auth(key),
    ).json()
    assert gql["data"]["workload"] == {
        "restartPolicy": {**policy, "counts": ["failure", "infrastructure"]},
        "restarts": {"failure": 2},
        "notBefore": None,
    }

    # The agent could not record a run's exit: restarted as infrastructure (not a failure of
    # the workload, not a hardware interruption), once, by the default policy.
    made = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 4, "region": "r1", "command": ["sleep", "60"]},
        headers=auth(key),
    )
    wid = made.json()["id"]
    wait_until(lambda: doc()["state"] == "provisioning", timeout=60)
    run = {"workload_id": wid, "attempt": 1, "replica": 0}
    client.post(
        "/v1/agent/status",
        json={"runs": [{**run, "state": "running", "pid": 9, "at": _now()}]},
        headers=auth(cred),
    )
    lost = {
        **run,
        "state": "lost",
        "at": _now(),
        "fault": "agent",
        "message": "the run's shim ended (code 1) but its exit record could not be read",
    }
    client.post("/v1/agent/status", json={"runs": [lost]}, headers=auth(cred))
    stopped = next(e for e in events() if e["to_state"] == "preempted")
    assert stopped["reason"].startswith("stopped: its node's agent could not record replica 0")
    assert stopped["details"]["fault"] == "agent"
    again = next(e for e in events() if e["from_state"] == "preempted")
    assert again["to_state"] == "queued" and "restart 1 of 10 (infrastructure)" in again["reason"]
    got = doc()
    assert got["interruptions"] == 0 and got["restarts"] == {"infrastructure": 1}
    client.delete(f"/v1/workloads/{wid}", headers=auth(key))


def test_a_run_lost_in_its_grace_is_stopped_not_failed(
    client, world, session, celery_worker_process
):
    """Its node was drained (the workload checkpoints in its grace) and then the run was lost
    (the host went): it was on its way off, so it goes back to the queue by its preemption,
    never `failed` for its own fault."""
    world.fleet(AGENT_FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    cred = join_node(client, op, "a-1")
    bring_up(client, cred, fake_inventory("a-1"))
    made = client.post(
        "/v1/workloads",
        json={"kind": "job", "gpus": 4, "region": "r1", "command": ["sleep", "600"]},
        headers=auth(key),
    )
    wid = made.json()["id"]
    wait_until(lambda: _state(client, key, wid) == "provisioning", timeout=60)
    run = {"workload_id": wid, "attempt": 1, "replica": 0}
    client.post(
        "/v1/agent/status",
        json={"runs": [{**run, "state": "running", "pid": 9, "at": _now()}]},
        headers=auth(cred),
    )
    assert _state(client, key, wid) == "running"
    nodes = client.get("/v1/admin/nodes", params={"limit": 50}, headers=auth(op)).json()["items"]
    nid = next(n["id"] for n in nodes if n["name"] == "a-1")
    drained = client.patch(f"/v1/admin/nodes/{nid}", json={"state": "draining"}, headers=auth(op))
    assert drained.status_code == 200, drained.text
    assert _state(client, key, wid) == "checkpointing"
    lost = {**run, "state": "lost", "at": _now(), "message": "gone with its host"}
    r = client.post("/v1/agent/status", json={"runs": [lost]}, headers=auth(cred))
    assert r.json() == {"accepted": 1, "stale": 0}, r.text

    def events():
        return client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]

    # (Back in the queue, it may be placed again on a-2, which has no agent.)
    back = wait_until(
        lambda: next((e for e in events() if e["from_state"] == "preempted"), None), timeout=30
    )
    assert back["to_state"] == "queued" and "(preemptions do not count)" in back["reason"]
    assert not any(e["to_state"] == "failed" for e in events())


PCIE = """
regions:
  - name: r1
    racks:
      - name: pcie-a
        kind: pcie
        nodes:
          - {name: h200-vm, gpu_model: H100-80GB, gpus: 4, agent: true}
          - {name: l4-box, gpu_model: L4-24GB, gpus: 2, agent: true}
"""


def test_a_pcie_host_is_adopted_from_its_agent_and_works_only_after_bring_up(
    client, world, session
):
    """Issue 45 item 11: the real H200 host (1 GPU) could not be described (`hgx nodes have
    8 or 4 GPUs; got 1`), and its GPUs had to be typed twice. A `pcie` rack takes 1 to 10
    GPUs; an adopting join token lets the agent's inventory complete the node's record; a
    node imported for an agent takes no work until it has joined and passed burn-in."""
    from app.models.fleet import Node

    world.fleet(PCIE)
    op = world.key()
    key = world.key(world.tenant("acme"))
    nodes = {n["name"]: n for n in client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]}
    assert {n["health"] for n in nodes.values()} == {"validating"}, nodes
    dry = client.post(
        "/v1/workloads:dry-run", json={"kind": "instance", "gpus": 1}, headers=auth(key)
    ).json()
    assert not dry["placeable_now"] and dry["reason"].startswith("waits: "), dry

    def gpu(node: str, i: int, model: str) -> dict:
        return {"index": i, "uuid": f"GPU-{node}-{i}", "model": model, "memory_mib": 143771}

    # A plain token: what the agent reads differs, so the node stays out.
    plain = join_node(client, op, "l4-box")
    got = client.put(
        "/v1/agent/inventory",
        json=fake_inventory("l4-box", [gpu("l4-box", 0, "L40S-48GB")]),
        headers=auth(plain),
    ).json()
    assert not got["matches"] and got["node_state"] == "validating", got

    # Work once ran there as the file described it: its GPUs' usage rows are 4 H100s'.
    from app.models.workloads import GpuUsage
    from app.placement.catalog import GPU_MODELS

    h200_id = uuid.UUID(nodes["h200-vm"]["id"])
    session.add_all(
        GpuUsage(node_id=h200_id, gpu_index=i, milli_used=0, memory_mib=81920, memory_used_mib=0)
        for i in range(4)
    )
    session.commit()
    # An adopting token: the host's one H200 becomes the record (the file said 4 H100s).
    made = client.post(
        f"/v1/admin/nodes/{nodes['h200-vm']['id']}/join-tokens",
        json={"adopt": True},
        headers=auth(op),
    )
    assert made.status_code == 201 and made.json()["adopt"] is True, made.text
    cred = client.post("/v1/agent/join", json={"token": made.json()["token"]}).json()["credential"]
    one_h200 = fake_inventory("h200-vm", [gpu("h200-vm", 0, "H200-141GB")])
    verdict = bring_up(client, cred, one_h200).json()
    assert verdict["matches"] and verdict["node_state"] == "ready", verdict
    node = client.get(f"/v1/admin/nodes/{nodes['h200-vm']['id']}", headers=auth(op)).json()
    assert (node["gpu_model"], node["health"]) == ("H200-141GB", "healthy"), node
    gpus = client.get("/v1/admin/gpus", params={"node_id": node["id"]}, headers=auth(op)).json()[
        "items"
    ]
    assert [(g["index"], g["model"], g["uuid"]) for g in gpus] == [
        (0, "H200-141GB", "GPU-h200-vm-0")
    ]
    session.expire_all()
    assert session.get(Node, uuid.UUID(node["id"])).adopt_inventory is False  # once
    usage = session.execute(
        select(GpuUsage.gpu_index, GpuUsage.memory_mib).where(GpuUsage.node_id == h200_id)
    ).all()
    assert usage == [(0, GPU_MODELS["H200-141GB"].memory_mib)], usage
    dry = client.post(
        "/v1/workloads:dry-run",
        json={"kind": "instance", "gpus": 1, "gpu_models": ["H200-141GB"]},
        headers=auth(key),
    ).json()
    assert dry["placeable_now"] and dry["placement"][0]["node"] == "h200-vm", dry

    # An adoption the rack's kind cannot sell is refused, and says why.
    again = client.post(
        f"/v1/admin/nodes/{nodes['l4-box']['id']}/join-tokens",
        json={"adopt": True},
        headers=auth(op),
    ).json()["token"]
    cred = client.post("/v1/agent/join", json={"token": again}).json()["credential"]
    got = client.put(
        "/v1/agent/inventory",
        json=fake_inventory("l4-box", [gpu("l4-box", 0, "GB200")]),
        headers=auth(cred),
    ).json()
    assert not got["matches"]
    assert "not adopted: GB200 is not sold in pcie racks" in got["differences"], got
    # A refused join token says what it is (it was titled as an API key).
    bad = client.post("/v1/agent/join", json={"token": again})
    assert bad.status_code == 401 and bad.json()["title"] == "Invalid join token"
