"""Dependencies and job arrays (issue 45 item 14) on a real worker (PostgreSQL, Redis, Celery):
`depends_on` holds work until what it names succeeded (Slurm's afterok) and fails it at once
when that can never be; an array's elements each get their index and at most `max_parallel`
of them are under way at once. REST, GraphQL and the CLI (the portal:
tests/portal/test_portal.py)."""

from __future__ import annotations

from datetime import datetime

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


def test_work_waits_for_what_it_depends_on_and_arrays_keep_their_limit(
    client, world, celery_worker_process
):
    world.fleet(FLEET)
    key = world.key(world.tenant("acme"))
    other = world.key(world.tenant("beta"))
    job = {"kind": "job", "gpus": 1}

    def submit(body: dict, k: str = key) -> dict:
        made = client.post("/v1/workloads", json={**job, **body}, headers=auth(k))
        assert made.status_code == 201, made.text
        return made.json()

    def read(wid: str) -> dict:
        return client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()

    def state(wid: str) -> str:
        return read(wid)["state"]

    # B waits for A: held (Dependency, naming A) while A runs, placed once A succeeded.
    a = submit({"name": "prep", "run_for_s": 4})
    b = submit({"name": "train", "run_for_s": 1, "depends_on": [a["id"]]})
    assert b["depends_on"] == [a["id"]]
    got = read(b["id"])
    assert got["state"] == "queued" and got["pending"]["reason"] == "Dependency", got
    assert "prep" in got["pending"]["detail"], got
    wait_until(lambda: state(b["id"]) == "succeeded", timeout=60)
    assert read(a["id"])["finished_at"] <= read(b["id"])["started_at"]

    # What it depends on is terminated: it fails at once, saying which, and so does its own
    # dependent in turn.
    c = submit({"name": "long", "run_for_s": 3600})
    d = submit({"name": "after-long", "run_for_s": 1, "depends_on": [c["id"]]})
    e = submit({"name": "after-that", "run_for_s": 1, "depends_on": [d["id"]]})
    assert client.delete(f"/v1/workloads/{c['id']}", headers=auth(key)).status_code in (200, 202)
    wait_until(lambda: state(e["id"]) == "failed", timeout=30)
    assert state(d["id"]) == "failed"
    events = client.get(f"/v1/workloads/{d['id']}/events", headers=auth(key)).json()["items"]
    last = events[-1]
    assert last["details"]["cause"] == "dependency_failed", last
    assert last["details"]["dependency"] == c["id"] and "long" in last["reason"], last
    assert read(d["id"])["started_at"] is None  # never ran, never billed

    # Bad input: clear errors, nothing written.
    gone = client.post("/v1/workloads", json={**job, "depends_on": [c["id"]]}, headers=auth(key))
    assert gone.status_code == 422 and gone.json()["code"] == "dependency_failed", gone.text
    theirs = client.post(
        "/v1/workloads", json={**job, "depends_on": [a["id"]]}, headers=auth(other)
    )
    assert theirs.status_code == 422 and theirs.json()["code"] == "unknown_dependency"
    assert a["id"] not in theirs.text or "no workload" in theirs.text.lower()
    twice = client.post(
        "/v1/workloads", json={**job, "depends_on": [a["id"], a["id"]]}, headers=auth(key)
    )
    assert twice.status_code == 422
    for bad in ({"count": 0}, {"count": 2, "max_parallel": 3}, {"count": 1001}):
        r = client.post("/v1/workloads", json={**job, "array": bad}, headers=auth(key))
        assert r.status_code == 422, (bad, r.text)
    r = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1, "array": {"count": 2}},
        headers=auth(key),
    )  # fmt: skip
    assert r.status_code == 422 and "only a job" in r.text
    n_before = len(client.get("/v1/workloads?limit=200", headers=auth(key)).json()["items"])

    # An array of 4, two at a time, each element its own index.
    first = submit({"name": "sweep", "run_for_s": 2, "array": {"count": 4, "max_parallel": 2}})
    arr = first["array"]
    assert arr["index"] == 0 and arr["count"] == 4 and arr["max_parallel"] == 2, first
    listed = client.get(f"/v1/workloads?array_id={arr['id']}", headers=auth(key)).json()["items"]
    assert sorted(w["array"]["index"] for w in listed) == [0, 1, 2, 3]
    assert len(client.get("/v1/workloads?limit=200", headers=auth(key)).json()["items"]) == (
        n_before + 4
    )
    held = [w for w in listed if w["array"]["index"] >= 2]
    assert all(w["pending"]["reason"] == "ArrayLimit" for w in held), held
    # Work after the whole array: by the array's id.
    after = submit({"name": "reduce", "run_for_s": 1, "depends_on": [arr["id"]]})
    wait_until(lambda: state(after["id"]) == "succeeded", timeout=90)
    elements = client.get(f"/v1/workloads?array_id={arr['id']}", headers=auth(key)).json()
    runs = [
        (datetime.fromisoformat(w["started_at"]), datetime.fromisoformat(w["finished_at"]))
        for w in elements["items"]
    ]
    assert all(w["state"] == "succeeded" for w in elements["items"]), elements
    # Never more than two under way: at each start, fewer than two others had started and
    # not yet finished.
    for start, _ in runs:
        assert sum(1 for s, f in runs if s < start < f) < 2, runs
    last_end = max(f for _, f in runs)
    assert datetime.fromisoformat(read(after["id"])["started_at"]) >= last_end

    # GraphQL and the CLI say the same.
    q = (
        f'{{ workloads(arrayId: "{arr["id"]}") {{ edges {{ node {{ array {{ index count '
        f'maxParallel }} }} }} }} workload(id: "{b["id"]}") {{ dependsOn }} }}'
    )
    data = client.post("/graphql", json={"query": q}, headers=auth(key)).json()["data"]
    assert sorted(e["node"]["array"]["index"] for e in data["workloads"]["edges"]) == [0, 1, 2, 3]
    assert data["workload"]["dependsOn"] == [a["id"]]
    m = (
        'mutation { submitWorkload(input: {kind: "job", gpus: 1, runForS: 1, dependsOn: ["'
        + c["id"]
        + '"]}) { __typename ... on ValidationProblem { code } } }'
    )
    out = client.post("/graphql", json={"query": m}, headers=auth(key)).json()["data"]
    assert out["submitWorkload"] == {"__typename": "ValidationProblem", "code": "dependency_failed"}
    shown = CliRunner().invoke(cli, ["workloads", "list", "--array", arr["id"]])
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("sweep") == 4, shown.output
