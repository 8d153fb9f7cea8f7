"""Volumes (issue 45 item 13): a tenant's named directories that its runs mount, on each
node's disk or on the fleet's shared storage. REST, GraphQL and the CLI on PostgreSQL; work
that mounts a shared volume lands only where the node's agent offers shared storage, and the
node's agent gets each mount in the run's assignment (what it does with them:
tests/agent/test_wall.py and test_container_wall.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from app.cli import cli
from tests.fixtures.agent_api import AGENT_FLEET, bring_up, fake_inventory, join_node
from tests.fixtures.world import auth, wait_until


def test_volumes_are_the_tenants_and_mount_where_their_storage_is(
    client, world, celery_worker_process
):
    world.fleet(AGENT_FLEET)
    op = world.key()
    acme = world.tenant("acme")
    key = world.key(acme)
    other = world.key(world.tenant("beta"))

    made = client.put("/v1/volumes/ckpt", json={"storage": "shared"}, headers=auth(key))
    assert made.status_code == 201, made.text
    assert made.json()["storage"] == "shared"
    again = client.put("/v1/volumes/ckpt", json={"storage": "shared"}, headers=auth(key))
    assert again.status_code == 200 and again.json()["id"] == made.json()["id"]
    fixed = client.put("/v1/volumes/ckpt", json={"storage": "node"}, headers=auth(key))
    assert fixed.status_code == 409 and fixed.json()["code"] == "volume_storage_fixed"
    assert client.put("/v1/volumes/scratch", json={}, headers=auth(key)).json()["storage"] == "node"
    names = [v["name"] for v in client.get("/v1/volumes", headers=auth(key)).json()["items"]]
    assert names == ["ckpt", "scratch"]
    # Another tenant's: not there to see; bad input: a clear error, nothing written.
    assert client.get("/v1/volumes/ckpt", headers=auth(other)).status_code == 404
    assert client.get("/v1/volumes", headers=auth(other)).json()["items"] == []
    assert client.get("/v1/volumes", headers=auth(op)).status_code == 403
    bad = client.put("/v1/volumes/no spaces", json={}, headers=auth(key))
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
    nfs = client.put("/v1/volumes/x", json={"storage": "nfs"}, headers=auth(key))
    assert nfs.status_code == 422

    job = {"kind": "job", "gpus": 2, "region": "r1", "command": ["train"]}

    def submit(k: str, **extra):
        return client.post("/v1/workloads", json={**job, **extra}, headers=auth(k))

    unknown = submit(key, volumes=[{"name": "nope", "mount_path": "data"}])
    assert unknown.status_code == 422 and unknown.json()["code"] == "unknown_volume"
    theirs = submit(other, volumes=[{"name": "ckpt", "mount_path": "data"}])
    assert theirs.status_code == 422 and theirs.json()["code"] == "unknown_volume"
    for bad_mount, why in (
        ({"name": "ckpt", "mount_path": "/abs"}, "relative"),
        ({"name": "ckpt", "mount_path": "a/../b"}, "`..`"),
        ({"name": "ckpt", "mount_path": "d", "read_only": True}, "read_only needs a container"),
    ):
        r = submit(key, volumes=[bad_mount])
        assert r.status_code == 422 and why in r.text, (bad_mount, r.text)
    podman = {**job, "runtime": "podman", "image": "img"}
    r = client.post(
        "/v1/workloads",
        json={**podman, "volumes": [{"name": "ckpt", "mount_path": "/proc/x"}]},
        headers=auth(key),
    )
    assert r.status_code == 422 and "container runtime's own" in r.text
    r = submit(
        key,
        volumes=[{"name": "ckpt", "mount_path": "d"}, {"name": "scratch", "mount_path": "d/e"}],
    )
    assert r.status_code == 422 and "nest" in r.text

    # Two agents' nodes: both mount volumes, only a-2 the fleet's shared storage.
    creds = {n: join_node(client, op, n) for n in ("a-1", "a-2")}
    for n in creds:
        inv = fake_inventory(n)
        inv["capabilities"] = ["volumes"] + (["shared-volumes"] if n == "a-2" else [])
        bring_up(client, creds[n], inv)
    mounts = [{"name": "ckpt", "mount_path": "ckpt"}, {"name": "scratch", "mount_path": "tmp2"}]
    w = submit(key, volumes=mounts, gpus=4)  # the whole of a node
    assert w.status_code == 201, w.text
    wid = w.json()["id"]
    assert w.json()["volumes"] == [
        {"name": "ckpt", "storage": "shared", "mount_path": "ckpt", "read_only": False},
        {"name": "scratch", "storage": "node", "mount_path": "tmp2", "read_only": False},
    ]

    def assigned(node: str) -> list[dict]:
        got = client.get("/v1/agent/assignments", headers=auth(creds[node])).json()
        return [a for a in got["assignments"] if a["workload_id"] == wid]

    wait_until(lambda: assigned("a-2"), timeout=30)
    assert assigned("a-1") == []
    (a,) = assigned("a-2")
    assert [(v["name"], v["storage"], v["mount_path"]) for v in a["volumes"]] == [
        ("ckpt", "shared", "ckpt"),
        ("scratch", "node", "tmp2"),
    ]
    assert a["volumes"][0]["id"] == made.json()["id"] and a["tenant"] == str(acme.id)
    # A second one waits for a-2, though a-1 is free; work with node volumes only goes there.
    second = submit(key, volumes=mounts[:1], gpus=4).json()["id"]
    local = submit(key, volumes=mounts[1:], gpus=4).json()["id"]

    def on(node: str, workload: str) -> bool:
        got = client.get("/v1/agent/assignments", headers=auth(creds[node])).json()
        return any(x["workload_id"] == workload for x in got["assignments"])

    # (Before the placement core's fail cache knew a shape's software, `second` failing made
    # `local` "known to fail" too.)
    wait_until(lambda: on("a-1", local), timeout=30)
    got = client.get(f"/v1/workloads/{second}", headers=auth(key)).json()
    assert got["state"] == "queued" and not on("a-1", second), got
    for done in (second, local):
        client.delete(f"/v1/workloads/{done}", headers=auth(key))

    # A volume a live workload mounts is not deleted; GraphQL and the CLI say the same.
    busy = client.delete("/v1/volumes/ckpt", headers=auth(key))
    assert busy.status_code == 409 and busy.json()["code"] == "volume_in_use"
    assert wid in busy.text
    q = 'mutation { deleteVolume(name: "ckpt") { __typename ... on Problem { code } } }'
    data = client.post("/graphql", json={"query": q}, headers=auth(key)).json()["data"]
    assert data["deleteVolume"] == {"__typename": "ConflictProblem", "code": "volume_in_use"}
    q = f'{{ volumes {{ edges {{ node {{ name storage }} }} }} workload(id: "{wid}") ' \
        "{ volumes { name storage mountPath readOnly } } }"  # fmt: skip
    data = client.post("/graphql", json={"query": q}, headers=auth(key)).json()["data"]
    assert [e["node"]["name"] for e in data["volumes"]["edges"]] == ["ckpt", "scratch"]
    assert data["workload"]["volumes"][0] == {
        "name": "ckpt", "storage": "shared", "mountPath": "ckpt", "readOnly": False,
    }  # fmt: skip
    m = (
        'mutation { submitWorkload(input: {kind: "job", gpus: 1, command: ["x"], volumes: '
        '[{name: "nope", mountPath: "x"}]}) { __typename ... on ValidationProblem { code } } }'
    )
    data = client.post("/graphql", json={"query": m}, headers=auth(key)).json()["data"]
    assert data["submitWorkload"] == {"__typename": "ValidationProblem", "code": "unknown_volume"}
    runner = CliRunner()
    listed = runner.invoke(cli, ["volumes", "list", "--tenant", "acme"])
    assert listed.exit_code == 0 and "ckpt" in listed.output and "shared" in listed.output
    refused = runner.invoke(cli, ["volumes", "delete", "ckpt", "--tenant", "acme"])
    assert refused.exit_code == 2 and "volume_in_use" in refused.output
    assert client.delete(f"/v1/workloads/{wid}", headers=auth(key)).status_code in (200, 202)
    made_cli = runner.invoke(cli, ["volumes", "create", "data", "--tenant", "acme"])
    assert made_cli.exit_code == 0 and "made" in made_cli.output, made_cli.output
    gone = runner.invoke(cli, ["volumes", "delete", "ckpt", "--tenant", "acme"])
    assert gone.exit_code == 0, gone.output
    assert client.get("/v1/volumes/ckpt", headers=auth(key)).status_code == 404
