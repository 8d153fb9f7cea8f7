"""What `GET /v1/capacity` and `rackplane fleet show` say is free is what is free: net of the
live whole-GPU, gang, VM, MIG and fractional allocations a real worker made (PostgreSQL, Redis,
a Celery worker)."""

from __future__ import annotations

from tests.fixtures.world import auth, wait_until

ALL = ["shared-timeslice", "shared-fractional", "shared-mig", "dedicated-gpu", "vm"]
FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-1
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: h1}, {name: h2}, {name: h3, mig_gpus: [7]}]
"""


def _row(client, key):
    [row] = client.get("/v1/capacity", headers=auth(key)).json()["items"]
    return row


def test_capacity_subtracts_every_live_allocation(client, world, celery_worker_process):
    world.fleet(FLEET)
    key = world.key(world.tenant("acme", policy=ALL))
    empty = _row(client, key)
    assert (empty["total_gpus"], empty["free_gpus"], empty["free_milli"]) == (24, 23, 23000)
    assert empty["free_mig"]["3g.40gb"] == 2 and empty["free_mig"]["1g.10gb"] == 7
    bodies = [
        {"kind": "job", "gpus": 4, "replicas": 2},  # a gang: 8 GPUs
        {"kind": "vm", "gpus": 2},
        {"kind": "instance", "mig_profile": "3g.40gb"},
        {"kind": "instance", "milli": 300, "gpu_memory_mib": 20000},
    ]
    ids = []
    for body in bodies:
        r = client.post("/v1/workloads", json=body, headers=auth(key))
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])

    def all_running():
        states = [client.get(f"/v1/workloads/{w}", headers=auth(key)).json()["state"] for w in ids]
        return all(s == "running" for s in states)

    wait_until(all_running, timeout=60)
    row = _row(client, key)
    # 23 whole: 8 (gang) + 2 (VM) + 1 (the share's GPU) are taken.
    assert row["free_gpus"] == 23 - 8 - 2 - 1
    assert row["free_milli"] == 23000 - 8000 - 2000 - 300
    # One 3g.40gb on the MIG GPU: one more 3g fits, and four 1g (7 compute - 3 used).
    assert row["free_mig"]["3g.40gb"] == 1 and row["free_mig"]["1g.10gb"] == 4
    # Operators see who holds what: the workloads on a node, and each GPU's holders with
    # the MIG layout and the shares.
    op = world.key(None)
    everyone = client.get("/v1/admin/workloads", headers=auth(op)).json()["items"]
    assert {w["id"] for w in everyone} == set(ids) and everyone[0]["tenant_id"]
    nodes = {
        n["name"]: n["id"] for n in client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]
    }
    h3 = client.get(f"/v1/admin/nodes/{nodes['h3']}", headers=auth(op)).json()
    [mig] = [h for g in h3["gpus"] if g["mig_mode"] for h in g["holders"]]
    assert (mig["workload_id"], mig["mig_profile"], mig["mig_slot"]) == (
        ids[2],
        "3g.40gb",
        mig["mig_slot"],
    )
    assert mig["mig_slot"] is not None
    on_h3 = client.get("/v1/admin/workloads", params={"node": "h3"}, headers=auth(op)).json()
    assert ids[2] in {w["id"] for w in on_h3["items"]}
    shares = [
        (g, h)
        for n in nodes.values()
        for g in client.get(f"/v1/admin/nodes/{n}", headers=auth(op)).json()["gpus"]
        for h in g["holders"]
        if h["workload_id"] == ids[3]
    ]
    [(gpu, share)] = shares
    assert share["milli"] == 300 and share["gpu_memory_mib"] == 20000 and gpu["free_milli"] == 700
    one = client.get(f"/v1/admin/gpus/{gpu['id']}", headers=auth(op)).json()
    assert one["holders"] == [share]
    running = client.get(
        "/v1/admin/workloads", params={"state": "running", "kind": "vm"}, headers=auth(op)
    ).json()["items"]
    assert [w["id"] for w in running] == [ids[1]]
    for w in ids:
        client.delete(f"/v1/workloads/{w}", headers=auth(key))
    assert wait_until(lambda: _row(client, key) == empty, timeout=30)


def test_capacity_counts_only_the_instances_an_agents_gpu_has(client, world, session):
    """Issue 45 item 7: capacity showed a free 7g.80gb on an agent's GPU laid out as seven
    1g slices (or being laid out again), where placement could put none."""
    import json

    from sqlalchemy import text

    world.fleet(FLEET)
    key = world.key(world.tenant("acme", policy=ALL))
    assert _row(client, key)["free_mig"]["7g.80gb"] == 1  # a simulated GPU: any layout
    seven = [["1g", s] for s in range(7)]
    session.execute(
        text("UPDATE gpus SET mig_layout = CAST(:l AS json) WHERE mig_mode"),
        {"l": json.dumps(seven)},
    )
    session.commit()
    free = _row(client, key)["free_mig"]
    assert free == {"1g.10gb": 7}, free  # what its agent reported, and only that
    session.execute(text("UPDATE gpus SET relayout_pending = true WHERE mig_mode"))
    session.commit()
    row = _row(client, key)
    assert row["free_mig"] == {} and row["free_gpus"] == 23  # being laid out: no work on it
