"""What `GET /v1/capacity` and `rackplane fleet show` say is free is what is free: net of the
live whole-GPU, gang, VM, MIG and fractional allocations a real worker made (PostgreSQL, Redis,
a Celery worker)."""

from __future__ import annotations

from tests.conftest import auth, wait_until

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
    for w in ids:
        client.delete(f"/v1/workloads/{w}", headers=auth(key))
    assert wait_until(lambda: _row(client, key) == empty, timeout=30)
