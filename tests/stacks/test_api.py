"""Software stacks: operators declare them and which nodes run each; an agent's inventory that
differs makes its node drifted (each component named); placement keeps gangs off drifted nodes
and on one stack, and honours a workload's stack and minimum CUDA version. REST and GraphQL."""

from __future__ import annotations

from tests.fixtures.agent_api import bring_up, fake_inventory, join_node
from tests.fixtures.world import auth, wait_until

FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-s
        kind: hgx
        gpu_model: H100-80GB
        pool: train
        nodes:
          - {name: s-1, gpus: 4}
          - {name: s-2, gpus: 4}
          - {name: s-3, gpus: 4}
"""
NEW = {"driver": "560.35.03", "cuda": "12.6", "nccl": "2.23.4", "os_image": "ubuntu-22.04-gpu"}
OLD = {"driver": "550.54.15", "cuda": "12.4"}


def _node(client, op, name):
    nodes = client.get("/v1/admin/nodes", params={"limit": 50}, headers=auth(op)).json()["items"]
    return next(n for n in nodes if n["name"] == name)


def _stack(client, op, name):
    return client.get(f"/v1/admin/stacks/{name}", headers=auth(op)).json()


def test_stacks_drift_and_placement(client, world, celery_worker_process):
    world.fleet(FLEET)
    op = world.key()
    key = world.key(world.tenant("acme"))

    # Declared once, never changed; bad ones named.
    made = client.post(
        "/v1/admin/stacks", json={"name": "h100-2026.10", "components": NEW}, headers=auth(op)
    )
    assert made.status_code == 201, made.text
    assert made.json()["components"] == NEW and made.json()["nodes"] == 0
    again = client.post(
        "/v1/admin/stacks", json={"name": "h100-2026.10", "components": OLD}, headers=auth(op)
    )
    assert again.status_code == 409 and again.json()["code"] == "stack_exists"
    bad = client.post(
        "/v1/admin/stacks",
        json={"name": "x", "components": {"cuda": "twelve"}},
        headers=auth(op),
    )
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
    assert client.get("/v1/admin/stacks/nope", headers=auth(op)).json()["code"] == (
        "stack_not_found"
    )
    assert client.get("/v1/admin/stacks", headers=auth(key)).status_code == 403
    client.post(
        "/v1/admin/stacks", json={"name": "h100-2025.10", "components": OLD}, headers=auth(op)
    )

    # The pool runs the new stack; an unknown pool is named.
    assigned = client.post(
        "/v1/admin/stacks/h100-2026.10/assignments", json={"pool": "train"}, headers=auth(op)
    )
    assert assigned.json() == {"stack": "h100-2026.10", "nodes": 3, "drifted": 0}, assigned.text
    nowhere = client.post(
        "/v1/admin/stacks/h100-2026.10/assignments", json={"pool": "infer"}, headers=auth(op)
    )
    assert nowhere.status_code == 404 and nowhere.json()["code"] == "pool_not_found"
    both = client.post(
        "/v1/admin/stacks/h100-2026.10/assignments",
        json={"pool": "train", "nodes": ["s-1"]},
        headers=auth(op),
    )
    assert both.status_code == 422

    # Agents report what they run: s-2 runs the old driver and is drifted, named.
    creds = {n: join_node(client, op, n) for n in ("s-1", "s-2")}
    bring_up(client, creds["s-1"], fake_inventory("s-1"))
    bring_up(client, creds["s-2"], {**fake_inventory("s-2"), "driver_version": "550.54.15"})
    assert _node(client, op, "s-2")["drift"] == [
        "driver 550.54.15 (stack h100-2026.10 pins 560.35.03)"
    ]
    assert _node(client, op, "s-1")["drift"] == []
    assert _node(client, op, "s-1")["pool"] == "train"
    assert (
        _stack(client, op, "h100-2026.10")["nodes"],
        _stack(client, op, "h100-2026.10")["drifted"],
    ) == (3, 1)

    # What a workload asks of the software: checked at once, or placed accordingly.
    unknown = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1, "stack": "nope"}, headers=auth(key)
    )
    assert unknown.status_code == 422 and unknown.json()["code"] == "unknown_stack"
    for cuda, placeable in (("12.6", True), ("12.8", False)):
        dry = client.post(
            "/v1/workloads:dry-run",
            json={"kind": "instance", "gpus": 4, "min_cuda": cuda},
            headers=auth(key),
        )
        assert dry.status_code == 200, dry.text
        assert dry.json()["placeable_now"] is placeable, (cuda, dry.json())
    old_stack = client.post(
        "/v1/workloads:dry-run",
        json={"kind": "instance", "gpus": 1, "stack": "h100-2025.10"},
        headers=auth(key),
    )
    assert old_stack.json()["placeable_now"] is False, "no node runs the old stack"

    # A gang keeps off the drifted node; single-node work still goes there.
    def submit(body):
        r = client.post("/v1/workloads", json=body, headers=auth(key))
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def nodes_of(wid):
        return {
            p["node"]
            for p in client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["placement"] or []
        }

    gang = submit({"kind": "job", "gpus": 4, "replicas": 2, "min_cuda": "12.4"})
    wait_until(lambda: nodes_of(gang), timeout=60)
    assert nodes_of(gang) == {"s-1", "s-3"}
    w = client.get(f"/v1/workloads/{gang}", headers=auth(key)).json()
    assert w["min_cuda"] == "12.4" and w["stack"] is None
    second = submit({"kind": "job", "gpus": 4, "replicas": 2})
    single = submit({"kind": "instance", "gpus": 4})
    wait_until(lambda: nodes_of(single), timeout=60)
    assert nodes_of(single) == {"s-2"}, "the drifted node takes single-node work"
    assert nodes_of(second) == set(), "no gang on the drifted node"

    # The node is upgraded: a matching inventory clears its drift.
    client.put("/v1/agent/inventory", json=fake_inventory("s-2"), headers=auth(creds["s-2"]))
    assert _node(client, op, "s-2")["drift"] == []

    # GraphQL: the same service functions, the same codes.
    def gql(query, **variables):
        r = client.post("/graphql", json={"query": query, "variables": variables}, headers=auth(op))
        assert r.status_code == 200, r.text
        return r.json()

    listed = gql("{ softwareStacks { name nodes drifted components } }")["data"]
    assert [(s["name"], s["nodes"], s["drifted"]) for s in listed["softwareStacks"]] == [
        ("h100-2025.10", 0, 0),
        ("h100-2026.10", 3, 0),
    ]
    moved = gql(
        """mutation($n: String!) { assignStack(name: $n, input: {nodes: ["s-3"]}) {
        __typename ... on StackAssigned { nodes drifted } ... on Problem { code } } }""",
        n="h100-2025.10",
    )["data"]["assignStack"]
    assert moved == {"__typename": "StackAssigned", "nodes": 1, "drifted": 0}
    missing = gql(
        """mutation { assignStack(name: "nope", input: {pool: "train"}) {
        __typename ... on Problem { code } } }"""
    )["data"]["assignStack"]
    assert missing["code"] == "stack_not_found"
    created = gql(
        """mutation { createStack(input: {name: "h100-2027.01",
        components: {driver: "570.1", cuda: "12.8"}}) {
        __typename ... on SoftwareStack { name components } } }"""
    )["data"]["createStack"]
    assert created == {
        "__typename": "SoftwareStack",
        "name": "h100-2027.01",
        "components": {"driver": "570.1", "cuda": "12.8"},
    }
