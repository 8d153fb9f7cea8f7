"""Rolling upgrades on the control plane (PostgreSQL, Redis, a real worker): a pool's nodes
move to a new stack one unit at a time within the unavailability budget; work that
checkpoints moves at its checkpoint; each node's agent gets one job (the operator's install
commands for what differs, then the burn-in suite) and reports a fresh inventory; a failed
install or a node still on the old versions pauses the upgrade; resume tries again; a rollback
takes every touched node back. The agents here are the test, speaking the wire
(tests/agents/test_e2e.py drives real agents through an upgrade)."""

from __future__ import annotations

import uuid

from sqlalchemy import select, update

from app.core.config import get_settings
from tests.fixtures.agent_api import bring_up, fake_inventory, join_node
from tests.fixtures.world import auth, wait_until

FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-u
        kind: hgx
        gpu_model: H100-80GB
        pool: train
        nodes:
          - {name: u-1, gpus: 4}
          - {name: u-2, gpus: 4}
          - {name: u-3, gpus: 4}
"""
OLD = {"driver": "550.54.15", "cuda": "12.4"}
NEW = {"driver": "560.35.03", "cuda": "12.6"}


def _inv(node: str, stack: dict) -> dict:
    inv = fake_inventory(node)
    return {**inv, "driver_version": stack["driver"], "cuda_version": stack["cuda"]}


def _job(client, cred):
    return client.get("/v1/agent/assignments", params={"wait": "0s"}, headers=auth(cred)).json()[
        "burn_in"
    ]


def _finish(client, cred, job, node, stack, fail: str | None = None):
    """The agent's report of its job: every step passed (but `fail`), with the inventory it
    read again (running `stack`)."""
    results = []
    for s in job["steps"]:
        if s["name"] == fail:
            results.append(
                {"name": s["name"], "status": "failed", "seconds": 3, "detail": "exit 1: no"}
            )
            break
        results.append({"name": s["name"], "status": "passed", "seconds": 1})
    r = client.post(
        "/v1/agent/status",
        json={
            "burn_in": {"id": job["id"], "results": results, "done": True},
            "inventory": _inv(node, stack),
        },
        headers=auth(cred),
    )
    assert r.status_code == 200, r.text


def _node(client, op, name):
    nodes = client.get("/v1/admin/nodes", params={"limit": 50}, headers=auth(op)).json()["items"]
    return next(n for n in nodes if n["name"] == name)


def test_a_rolling_upgrade_pause_resume_and_rollback(
    client, world, session, celery_worker_process, tmp_path, monkeypatch
):
    from app.fleet import upgrades
    from app.models.fleet import Upgrade

    world.fleet(FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))
    sid = {}
    for name, comps in (("h100-old", OLD), ("h100-new", NEW)):
        r = client.post(
            "/v1/admin/stacks", json={"name": name, "components": comps}, headers=auth(op)
        )
        assert r.status_code == 201, r.text
        sid[name] = r.json()["id"]
    client.post("/v1/admin/stacks/h100-old/assignments", json={"pool": "train"}, headers=auth(op))
    creds = {n: join_node(client, op, n) for n in ("u-1", "u-2", "u-3")}
    for n, cred in creds.items():
        bring_up(client, cred, _inv(n, OLD))

    def start(**body):
        return client.post(
            "/v1/admin/upgrades",
            json={"stack": "h100-new", "pool": "train", **body},
            headers=auth(op),
        )

    # Refusals, each named, nothing written.
    r = start()
    assert r.status_code == 422 and r.json()["code"] == "no_upgrade_command", r.text
    assert r.json()["components"] == ["cuda", "driver"]
    for bad in ({"batch": "0"}, {"batch": "101%"}, {"region": "r1"}, {"max_unavailable_pct": 0}):
        r = start(**bad)
        assert r.status_code == 422, (bad, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
    r = client.post("/v1/admin/upgrades", json={"stack": "nope", "pool": "train"}, headers=auth(op))
    assert r.status_code == 404 and r.json()["code"] == "stack_not_found"
    r = client.post(
        "/v1/admin/upgrades", json={"stack": "h100-new", "pool": "none"}, headers=auth(op)
    )
    assert r.status_code == 404 and r.json()["code"] == "pool_not_found"
    assert session.scalar(select(Upgrade.id)) is None

    cmds = tmp_path / "upgrade.yaml"
    cmds.write_text(
        "driver: {command: [/opt/rp/install-driver, '{version}'], timeout_s: 1200}\n"
        "cuda: {command: [/opt/rp/install-cuda, '{version}', '{stack}']}\n"
    )
    monkeypatch.setattr(get_settings(), "upgrade_commands", cmds)

    # A 4-GPU workload that checkpoints, on u-1 (the others cordoned while it is placed).
    for n in ("u-2", "u-3"):
        nid = _node(client, op, n)["id"]
        client.patch(f"/v1/admin/nodes/{nid}", json={"state": "cordoned"}, headers=auth(op))
    w = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 4, "checkpoint": {"interval_s": 600}},
        headers=auth(key),
    )
    assert w.status_code == 201, w.text
    wid = w.json()["id"]
    wait_until(
        lambda: client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["placement"],
        timeout=30,
    )
    for n in ("u-2", "u-3"):
        nid = _node(client, op, n)["id"]
        client.patch(f"/v1/admin/nodes/{nid}", json={"state": "ready"}, headers=auth(op))
    run = client.get("/v1/agent/assignments", params={"wait": "0s"}, headers=auth(creds["u-1"]))
    a = run.json()["assignments"][0]
    client.post(
        "/v1/agent/status",
        json={
            "runs": [
                {
                    "workload_id": wid,
                    "attempt": a["attempt"],
                    "replica": 0,
                    "state": "running",
                    "at": "2026-11-27T00:00:00+00:00",
                    "pid": 4242,
                }
            ]
        },
        headers=auth(creds["u-1"]),
    )
    wait_until(
        lambda: client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "running",
        timeout=20,
    )

    # Two units at once asked, but half the pool's GPUs is the budget: one node at a time.
    r = start(batch="2", max_unavailable_pct=50)
    assert r.status_code == 202, r.text
    up = r.json()
    uid = up["id"]
    assert (up["state"], up["units_at_once"], up["report"]["nodes"]) == ("running", 2, 3)
    assert start().json()["code"] == "upgrade_in_progress"

    def advance():
        session.expire_all()
        state = upgrades.advance(session, uuid.UUID(uid), _now())
        session.commit()
        return state

    def show():
        return client.get(f"/v1/admin/upgrades/{uid}", headers=auth(op)).json()

    def phases():
        return {n["node"]: n["phase"] for n in show()["nodes"]}

    advance()
    assert phases() == {"u-1": "draining", "u-2": "pending", "u-3": "pending"}
    assert _node(client, op, "u-1")["state"] == "cordoned"
    events = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
    told = [e for e in events if e["kind"] == "health"]
    assert told and "moves to another node at its next checkpoint" in told[-1]["reason"], told

    # Its checkpoint moves it (the worker's health.migrate): then the node is free.
    ck = client.post(
        f"/v1/workloads/{wid}/checkpoints",
        json={"size_bytes": 1024, "uri": "s3://ck/1", "step": 7},
        headers=auth(key),
    )
    assert ck.status_code in (200, 201), ck.text
    wait_until(
        lambda: (
            client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"]
            in ("queued", "placing", "provisioning")
        ),
        timeout=30,
    )
    advance()
    assert phases()["u-1"] == "applying" and phases()["u-2"] == "pending"
    n1 = _node(client, op, "u-1")
    assert (n1["state"], n1["health"]) == ("cordoned", "validating")
    assert n1["stack_id"] == sid["h100-new"] and n1["drift"], "drifted until it reports"
    job = _job(client, creds["u-1"])
    assert job["reinventory"] is True
    names = [s["name"] for s in job["steps"]]
    assert names == ["install-driver", "install-cuda", "dcgm-diag", "nccl-all-reduce"]
    assert job["steps"][0]["command"] == ["/opt/rp/install-driver", "560.35.03"]
    assert job["steps"][0]["timeout_s"] == 1200
    assert job["steps"][1]["command"] == ["/opt/rp/install-cuda", "12.6", "h100-new"]

    _finish(client, creds["u-1"], job, "u-1", NEW)
    advance()
    n1 = _node(client, op, "u-1")
    assert (n1["state"], n1["health"], n1["drift"]) == ("ready", "healthy", [])
    assert phases() == {"u-1": "done", "u-2": "applying", "u-3": "pending"}  # u-2: no work

    # u-2's driver will not install: paused at the first failure, u-3 not taken.
    _finish(client, creds["u-2"], _job(client, creds["u-2"]), "u-2", OLD, fail="install-driver")
    assert advance() == "paused"
    shown = show()
    assert "1 failure(s)" in shown["state_reason"] and "u-2" in shown["state_reason"]
    u2 = next(n for n in shown["nodes"] if n["node"] == "u-2")
    assert u2["phase"] == "failed" and "install-driver" in u2["detail"]
    assert phases()["u-3"] == "pending"
    n2 = _node(client, op, "u-2")
    assert n2["state"] == "cordoned" and "failed at install-driver" in n2["state_reason"]
    assert n2["health"] == "validating", "a failed install is not a hardware fault"

    # Resumed: u-2 is tried again. Its steps pass, but its agent still reports the old
    # versions: a failure too (verify), and paused again.
    r = client.post(f"/v1/admin/upgrades/{uid}/resume", headers=auth(op))
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    advance()
    assert phases()["u-2"] == "applying"
    _finish(client, creds["u-2"], _job(client, creds["u-2"]), "u-2", OLD)
    assert advance() == "paused"
    u2 = next(n for n in show()["nodes"] if n["node"] == "u-2")
    assert u2["detail"].startswith("failed at verify: still runs driver 550.54.15"), u2

    r = client.post(f"/v1/admin/upgrades/{uid}/rollback", headers=auth(op))
    assert r.status_code == 200 and r.json()["state"] == "rolling_back", r.text
    r = client.post(f"/v1/admin/upgrades/{uid}/resume", headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "invalid_upgrade_transition"

    # The rollback: u-1 (done) drains and installs the old stack; u-2 (failed) is burned in
    # on what it runs; u-3 was never reached and is left alone.
    advance()
    assert phases()["u-3"] == "skipped"
    jobs = {}
    for _ in range(6):
        for n in ("u-1", "u-2"):
            job = _job(client, creds[n])
            if job and job["id"] not in jobs.values():
                names = [s["name"] for s in job["steps"]]
                if n == "u-1":  # it runs the new stack: the old one is installed again
                    assert names[:2] == ["install-driver", "install-cuda"]
                    assert job["steps"][0]["command"][1] == "550.54.15"
                else:  # its install failed: it still runs the old one, only burned in
                    assert names == ["dcgm-diag", "nccl-all-reduce"]
                jobs[n] = job["id"]
                _finish(client, creds[n], job, n, OLD)
        if advance() == "rolled_back":
            break
    final = show()
    assert final["state"] == "rolled_back", final["nodes"]
    assert {n["node"]: n["phase"] for n in final["nodes"]} == {
        "u-1": "rolled_back",
        "u-2": "rolled_back",
        "u-3": "skipped",
    }
    for n in ("u-1", "u-2"):
        node = _node(client, op, n)
        assert (node["state"], node["health"]) == ("ready", "healthy"), node
        assert node["stack_id"] == sid["h100-old"] and node["drift"] == []
    metrics = client.get("/metrics").text
    assert 'rackplane_upgrade_nodes{phase="done"}' in metrics  # finished: none counted
    assert "rackplane_bring_up_stuck_nodes" in metrics
    report = final["report"]
    assert report["work_moved"] == 1 and report["failures"] == 2
    assert report["gpu_hours_out_of_service"] > 0


def _now():
    from app.core.db import utcnow

    return utcnow()


def test_an_nvl72_domain_moves_as_one_unit(client, world, session, tmp_path, monkeypatch):
    """An NVL72 rack's 18 trays are one NVLink domain: an upgrade takes them together, whatever
    the batch, and the budget still lets the unit start alone (72 GPUs of 80 are more than
    any share of them). An HGX node beside it is a unit of its own."""
    from app.core.db import utcnow
    from app.fleet import upgrades
    from app.models.agents import AgentNode
    from app.models.fleet import Node
    from app.models.health import BurnIn

    world.fleet(
        """
regions:
  - name: r1
    racks:
      - {name: nvl-u, kind: nvl72, block: s1, pool: gb}
      - name: hgx-v
        kind: hgx
        gpu_model: H100-80GB
        pool: gb
        nodes:
          - {name: v-1, gpus: 8}
"""
    )
    op = world.key()
    r = client.post(
        "/v1/admin/stacks",
        json={"name": "gb-new", "components": NEW},
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    # Their agents, as the rows their inventories leave (the versions unknown: nothing to
    # install, only the burn-in).
    nodes = list(session.scalars(select(Node).order_by(Node.name)))
    for n in nodes:
        inv = {"hostname": n.name, "driver_version": None, "cuda_version": None}
        session.add(
            AgentNode(
                node_id=n.id,
                node_name=n.name,
                address=f"{n.name}.test",
                agent_version="test",
                inventory=inv,
            )
        )
    session.commit()
    r = client.post(
        "/v1/admin/upgrades",
        json={"stack": "gb-new", "pool": "gb", "batch": "1", "max_unavailable_pct": 10},
        headers=auth(op),
    )
    assert r.status_code == 202, r.text
    up = r.json()
    units = {n["node"]: n["unit"] for n in up["nodes"]}
    trays = [name for name in units if name != "v-1"]
    assert len(trays) == 18 and len({units[t] for t in trays}) == 1
    assert units["v-1"] != units[trays[0]]
    session.expire_all()
    upgrades.advance(session, uuid.UUID(up["id"]), utcnow())
    session.commit()

    def phases() -> dict[str, str]:
        shown = client.get(f"/v1/admin/upgrades/{up['id']}", headers=auth(op)).json()
        return {n["node"]: n["phase"] for n in shown["nodes"]}

    # v-1's unit comes first (racks by name); 8 GPUs fit the budget (10 % of 80), and the
    # domain's 72 may not start beside it.
    got = phases()
    assert got["v-1"] == "applying" and all(got[t] == "pending" for t in trays), got
    # v-1 passes its burn-in (as the rows its agent's report leaves): the domain, alone
    # now, goes whole, every tray at once.
    session.execute(update(BurnIn).where(BurnIn.status == "running").values(status="passed"))
    session.execute(update(Node).where(Node.name == "v-1").values(health="healthy"))
    session.commit()
    upgrades.advance(session, uuid.UUID(up["id"]), utcnow())
    session.commit()
    got = phases()
    assert got["v-1"] == "done" and all(got[t] == "applying" for t in trays), got
