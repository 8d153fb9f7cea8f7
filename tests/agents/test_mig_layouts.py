"""MIG layouts through the node agent, on the control plane (PostgreSQL, Redis, a real worker):
an operator lays an idle GPU out; until its agent reports, the GPU takes no work; the agent's
report of what the GPU really has becomes where MIG work goes, and the UUIDs it reported are
what the work's CUDA_VISIBLE_DEVICES names. A busy GPU, a layout the geometry forbids, an
agent that cannot lay instances out are refused; a placement planned before a relayout is
refused by the database. The agent here is the test, speaking the wire."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from tests.fixtures.agent_api import bring_up, fake_gpus, fake_inventory, join_node
from tests.fixtures.workloads import ALL
from tests.fixtures.world import auth, wait_until

FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-m
        kind: hgx
        gpu_model: H100-80GB
        nodes:
          - {name: m-1, gpus: 4}
          - {name: m-2, gpus: 4}
"""
LAID = [
    {"uuid": "MIG-m1-0-4", "profile": "3g.40gb", "start": 4},
    {"uuid": "MIG-m1-0-2", "profile": "2g.20gb", "start": 2},
    {"uuid": "MIG-m1-0-0", "profile": "1g.10gb", "start": 0},
    {"uuid": "MIG-m1-0-1", "profile": "1g.10gb", "start": 1},
]


def _inv(node: str, laid: list[dict] | None = None, capable: bool = True) -> dict:
    gpus = fake_gpus(node, 4)
    if laid is not None:
        gpus[0] = {**gpus[0], "mig_mode": True, "mig_instances": laid}
    return {**fake_inventory(node, gpus), "capabilities": ["mig-layout"] if capable else []}


def _gpu(client, op, node_id: str, index: int) -> dict:
    gpus = client.get("/v1/admin/gpus", params={"node_id": node_id}, headers=auth(op)).json()
    return next(g for g in gpus["items"] if g["index"] == index)


def test_an_operator_lays_a_gpu_out_and_mig_work_runs_on_what_the_agent_made(
    client, world, session, celery_worker_process
):
    world.fleet(FLEET)
    op = world.key()
    key = world.key(world.tenant("acme", policy=ALL))
    creds = {n: join_node(client, op, n) for n in ("m-1", "m-2")}
    bring_up(client, creds["m-1"], _inv("m-1"))
    bring_up(client, creds["m-2"], _inv("m-2", capable=False))
    nodes = client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]
    nid = {n["name"]: n["id"] for n in nodes}
    g0, g1 = (_gpu(client, op, nid["m-1"], i) for i in (0, 1))

    def lay(gpu: dict, profiles):
        return client.put(
            f"/v1/admin/gpus/{gpu['id']}/mig-layout", json={"profiles": profiles}, headers=auth(op)
        )

    # Refusals, each named; nothing asked of any agent.
    r = lay(g0, ["4g.40gb", "4g.40gb"])
    assert r.status_code == 422 and r.json()["code"] == "invalid_mig_layout", r.text
    r = lay(g0, ["5g.50gb"])
    assert r.status_code == 422 and r.json()["code"] == "unknown_mig_profile", r.text
    r = lay(_gpu(client, op, nid["m-2"], 0), ["7g.80gb"])
    assert r.status_code == 409 and r.json()["code"] == "agent_cannot_lay_out_mig", r.text
    assert (
        client.get(
            "/v1/agent/assignments", params={"wait": "0s"}, headers=auth(creds["m-1"])
        ).json()["mig_layouts"]
        == []
    )

    # Asked: the starts chosen to keep room, the GPU out of placement until the agent reports.
    r = lay(g0, ["1g.10gb", "3g.40gb", "2g.20gb", "1g.10gb"])
    assert r.status_code == 202, r.text
    asked = r.json()
    assert asked["status"] == "pending" and asked["mig_mode"] is True
    assert sorted((s["profile"], s["start"]) for s in asked["layout"]) == [
        ("1g.10gb", 0),
        ("1g.10gb", 1),
        ("2g.20gb", 2),
        ("3g.40gb", 4),
    ]
    assert _gpu(client, op, nid["m-1"], 0)["relayout_pending"] is True
    # MIG work waits: GPU 0 is being laid out, and GPU 1, whole, is never turned into MIG
    # mode as a side effect on an agent's node.
    w = client.post(
        "/v1/workloads", json={"kind": "instance", "mig_profile": "3g.40gb"}, headers=auth(key)
    )
    assert w.status_code == 201, w.text
    wid = w.json()["id"]
    desired = client.get(
        "/v1/agent/assignments", params={"wait": "0s"}, headers=auth(creds["m-1"])
    ).json()
    assert desired["assignments"] == []
    (layout,) = desired["mig_layouts"]
    assert (layout["id"], layout["gpu"], layout["mig_mode"]) == (asked["id"], 0, True)
    assert {(s["profile"], s["start"]) for s in layout["instances"]} == {
        (s["profile"], s["start"]) for s in asked["layout"]
    }
    assert client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "queued"

    # The agent applied it: its report (with the inventory it read again) is the truth.
    r = client.post(
        "/v1/agent/status",
        json={
            "mig_layouts": [
                {
                    "id": layout["id"],
                    "gpu": 0,
                    "status": "applied",
                    "mig_mode": True,
                    "instances": LAID,
                }
            ],
            "inventory": _inv("m-1", LAID),
        },
        headers=auth(creds["m-1"]),
    )
    assert r.status_code == 200, r.text
    g0 = _gpu(client, op, nid["m-1"], 0)
    assert (g0["mig_mode"], g0["relayout_pending"]) == (True, False)
    assert {(s["profile"], s["start"]) for s in g0["mig_layout"]} == {
        ("3g", 4),
        ("2g", 2),
        ("1g", 0),
        ("1g", 1),
    }
    node = client.get(f"/v1/admin/nodes/{nid['m-1']}", headers=auth(op)).json()
    assert node["state"] == "ready", "the new MIG mode matches its inventory"

    # The waiting work lands on the 3g instance the agent made, by its UUID.
    def placed():
        got = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
        return got if got["placement"] else None

    got = wait_until(placed, timeout=30)
    assert got["placement"][0]["gpu_indices"] == [0]
    run = client.get(
        "/v1/agent/assignments", params={"wait": "0s"}, headers=auth(creds["m-1"])
    ).json()["assignments"]
    assert run and run[0]["devices"] == ["MIG-m1-0-4"]
    assert run[0]["env"]["CUDA_VISIBLE_DEVICES"] == "MIG-m1-0-4"

    # A busy GPU is not laid out again; an idle one whose usage row says so refuses work.
    r = lay(g0, None)
    assert r.status_code == 409 and r.json()["code"] == "gpu_busy", r.text
    r = lay(g1, ["7g.80gb"])
    assert r.status_code == 202, r.text
    session.commit()
    with pytest.raises(IntegrityError):
        session.execute(
            text(
                "UPDATE gpu_usage SET milli_used = 1000 WHERE gpu_index = 1 AND node_id = "
                f"'{nid['m-1']}'"
            )
        )
    session.rollback()
    # Refused by the agent (it found a process on it): the GPU is usable again, as it was.
    rid = r.json()["id"]
    r = client.post(
        "/v1/agent/status",
        json={
            "mig_layouts": [{"id": rid, "gpu": 1, "status": "refused", "detail": "busy: pid 4242"}]
        },
        headers=auth(creds["m-1"]),
    )
    assert r.status_code == 200, r.text
    g1 = _gpu(client, op, nid["m-1"], 1)
    assert (g1["mig_mode"], g1["relayout_pending"], g1["mig_layout"]) == (False, False, None)


def test_layouts_follow_the_queue_through_the_agents(client, world, session, celery_worker_process):
    """The demand planner's edge: MIG work waits on an agent's node of whole GPUs, so one idle
    GPU is laid out for it (asked of the agent as an operator's layout is); once the agent has
    made it, the work runs there; a GPU just laid out is not touched again (dwell), and nothing
    changes while nothing waits."""
    from app.agents import miglayout
    from app.core.db import utcnow

    world.fleet(FLEET)
    op = world.key()
    key = world.key(world.tenant("acme", policy=ALL))
    cred = join_node(client, op, "m-1")
    bring_up(client, cred, _inv("m-1"))
    session.commit()
    assert miglayout.advance(session, "r1", utcnow()) == 0, "nothing waits: nothing changes"
    session.commit()
    ids = []
    for _ in range(3):
        w = client.post(
            "/v1/workloads", json={"kind": "instance", "mig_profile": "3g.40gb"}, headers=auth(key)
        )
        ids.append(w.json()["id"])
    session.expire_all()
    assert miglayout.advance(session, "r1", utcnow()) >= 1
    session.commit()
    desired = client.get("/v1/agent/assignments", params={"wait": "0s"}, headers=auth(cred)).json()[
        "mig_layouts"
    ]
    assert desired and all(x["mig_mode"] for x in desired)
    threes = sum(s["profile"] == "3g.40gb" for x in desired for s in x["instances"])
    assert threes >= 2, desired  # a 3g-heavy layout for a 3g queue
    assert miglayout.advance(session, "r1", utcnow()) == 0, "pending ones are not asked again"
    session.commit()
    # The agent made them as asked.
    reports, instances = [], []
    for x in desired:
        laid = [
            {
                "uuid": f"MIG-m1-{x['gpu']}-{s['start']}",
                "profile": s["profile"],
                "start": s["start"],
            }
            for s in x["instances"]
        ]
        reports.append(
            {
                "id": x["id"],
                "gpu": x["gpu"],
                "status": "applied",
                "mig_mode": True,
                "instances": laid,
            }
        )
        instances.append((x["gpu"], laid))
    inv = _inv("m-1")
    for gpu, laid in instances:
        inv["gpus"][gpu] = {**inv["gpus"][gpu], "mig_mode": True, "mig_instances": laid}
    r = client.post(
        "/v1/agent/status", json={"mig_layouts": reports, "inventory": inv}, headers=auth(cred)
    )
    assert r.status_code == 200, r.text
    for wid in ids[: min(3, threes)]:
        wait_until(
            lambda wid=wid: client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()[
                "placement"
            ],
            timeout=30,
        )
    session.expire_all()
    assert miglayout.advance(session, "r1", utcnow()) == 0, "just laid out: left alone"
    metrics = client.get("/metrics").text
    assert f'rackplane_mig_relayouts{{reason="demand",status="applied"}} {len(desired)}.0' in (
        metrics
    ), [x for x in metrics.splitlines() if "relayouts" in x]
