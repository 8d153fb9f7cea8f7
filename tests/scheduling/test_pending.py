"""Why a queued workload waits (issue 45 item 12), as Slurm's squeue REASON: written by its
region's placement cycle on a real worker (PostgreSQL, Redis, Celery), shown in REST, GraphQL
and the CLI (the portal's workload page: tests/portal/test_portal.py)."""

from __future__ import annotations

import uuid

from typer.testing import CliRunner

from app.cli import cli
from tests.fixtures.world import auth, wait_until

FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-1
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: h1}]
"""


def test_each_queued_workload_says_why_it_waits(client, world, session, celery_worker_process):
    world.fleet(FLEET)
    op = world.key()
    acme = world.tenant("acme")
    a = world.key(acme)
    b = world.key(world.tenant("beta"))
    r = client.put(
        f"/v1/admin/tenants/{acme.id}/quotas",
        json={"quotas": [{"gpu_model": "H100-80GB", "limit_milli": 8000}]},
        headers=auth(op),
    )
    assert r.status_code == 200, r.text

    def submit(key: str, gpus: int) -> str:
        made = client.post(
            "/v1/workloads",
            json={"kind": "job", "gpus": gpus, "run_for_s": 3600},
            headers=auth(key),
        )
        assert made.status_code == 201, made.text
        return made.json()["id"]

    def pending(key: str, wid: str) -> dict | None:
        got = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
        return got["pending"] if got["state"] == "queued" else None

    first = submit(a, 8)
    wait_until(lambda: client.get(f"/v1/workloads/{first}", headers=auth(a)).json()["state"]
               == "running", timeout=60)  # fmt: skip
    assert client.get(f"/v1/workloads/{first}", headers=auth(a)).json()["pending"] is None
    over = submit(a, 1)  # past acme's limit of 8
    full = submit(b, 8)  # the one node is full
    got = wait_until(lambda: (p := pending(a, over)) and p, timeout=30)
    assert got["reason"] == "QuotaExhausted", got
    got = wait_until(lambda: (p := pending(b, full)) and p, timeout=30)
    assert got["reason"] == "Resources", got

    # The node is cordoned: the gang now waits for a node to take work again, named.
    node = client.get("/v1/admin/nodes", headers=auth(op)).json()["items"][0]
    r = client.patch(f"/v1/admin/nodes/{node['id']}", headers=auth(op), json={"state": "cordoned"})
    assert r.status_code == 200, r.text
    got = wait_until(
        lambda: (p := pending(b, full)) and p["reason"] == "NodeNotReady" and p, timeout=30
    )
    assert "h1 (cordoned)" in got["detail"], got

    # GraphQL and the CLI say the same.
    q = f'{{ workload(id: "{full}") {{ state pending {{ reason detail since }} }} }}'
    data = client.post("/graphql", json={"query": q}, headers=auth(b)).json()["data"]
    assert data["workload"]["pending"]["reason"] == "NodeNotReady", data
    shown = CliRunner().invoke(cli, ["workloads", "show", full])
    assert shown.exit_code == 0, shown.output
    assert "waits:" in shown.output and "NodeNotReady" in shown.output, shown.output
    listed = CliRunner().invoke(cli, ["workloads", "list", "--tenant", "beta"])
    assert "queued (NodeNotReady)" in listed.output, listed.output
    # Another tenant's workload (and so its reason) is not there to read.
    assert client.get(f"/v1/workloads/{full}", headers=auth(a)).status_code == 404

    # Back in service, but its agent runs only containers: work that needs `process` waits
    # for a node that runs it, said so (not "what runs must end first"), and a dry-run says
    # the same.
    from app.models.fleet import Node

    session.get(Node, uuid.UUID(node["id"])).agent_offers = ["podman"]
    session.commit()
    r = client.patch(f"/v1/admin/nodes/{node['id']}", headers=auth(op), json={"state": "ready"})
    assert r.status_code == 200, r.text
    got = wait_until(
        lambda: (p := pending(b, full)) and p["reason"] == "RuntimeNotOffered" and p, timeout=30
    )
    assert "no node here runs process work" in got["detail"], got
    dry = client.post(
        "/v1/workloads:dry-run", json={"kind": "job", "gpus": 1}, headers=auth(b)
    ).json()
    assert not dry["placeable_now"] and "no node here runs process work" in dry["reason"], dry
