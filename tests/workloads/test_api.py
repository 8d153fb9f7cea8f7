"""Workloads on the API (real PostgreSQL): submission and tier choice, refusals that name the
rule, hard limits, the lifecycle's transitions and timeline, checkpoints, quotas."""

from __future__ import annotations

import pytest

from app.scheduling.pending import REASONS
from tests.fixtures.world import auth

ALL = [
    "shared-timeslice",
    "shared-fractional",
    "shared-mig",
    "dedicated-gpu",
    "vm",
    "confidential-vm",
]


# Every node cordoned: a worker process left running by another test module must not place
# these workloads while the tests look at them queued.
FLEET = """
regions:
  - name: r1
    racks:
      - name: hgx-h100
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: h100-1, state: cordoned}]
      - name: hgx-h200
        kind: hgx
        gpu_model: H200-141GB
        nodes: [{name: h200-1, state: cordoned}]
  - name: r2
    racks:
      - name: hgx-a100
        kind: hgx
        gpu_model: A100-80GB
        nodes: [{name: a100-1, state: cordoned}]
"""


@pytest.fixture(autouse=True)
def fleet(world):
    world.fleet(FLEET)


@pytest.fixture
def tenant(world):
    t = world.tenant("acme", policy=ALL)
    return t, world.key(t)


def _submit(client, key, **body):
    return client.post("/v1/workloads", json=body, headers=auth(key))


def _events(client, key, wid):
    r = client.get(f"/v1/workloads/{wid}/events", headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["items"]


def test_a_gang_job_is_accepted_queued_and_its_timeline_says_why(client, tenant):
    _, key = tenant
    r = _submit(
        client,
        key,
        kind="job",
        gpus=2,
        replicas=4,
        gpu_models=["H100-80GB"],
        topology={"level": "nvlink_domain", "mode": "required"},
        priority="production",
        max_runtime_s=7200,
        checkpoint={"interval_s": 900, "cost_s": 60},
        labels={"team": "llm"},
    )
    assert r.status_code == 201, r.text
    w = r.json()
    assert r.headers["location"] == f"/v1/workloads/{w['id']}"
    assert (w["state"], w["tier"], w["gpu_milli"], w["replicas"]) == (
        "queued",
        "dedicated",
        8_000,
        4,
    )
    assert w["topology"] == {"level": "nvlink_domain", "mode": "required"}
    ev = _events(client, key, w["id"])
    assert [(e["seq"], e["from_state"], e["to_state"]) for e in ev] == [
        (1, None, "pending"),
        (2, "pending", "queued"),
    ]
    assert ev[0]["reason"] == "submitted" and ev[0]["details"] == {"tier": "dedicated"}
    got = client.get(f"/v1/workloads/{w['id']}", headers=auth(key)).json()
    # Why it waits is the placement cycle's to say, whenever one runs (a worker of the session
    # may have run one since): the rest is what the submission answered.
    pending = got.pop("pending")
    assert pending is None or pending["reason"] in REASONS, pending
    w.pop("pending")
    assert got == w


@pytest.mark.parametrize(
    "body, tier, profile",
    [
        (
            {"kind": "instance", "mig_profile": "3g.40gb", "gpu_models": ["H100-80GB"]},
            "mig-shared",
            "3g",
        ),
        (
            {"kind": "instance", "mig_profile": "1g.18gb", "gpu_models": ["H200-141GB"]},
            "mig-shared",
            "1g",
        ),
        ({"kind": "instance", "mig_profile": "2g"}, "mig-shared", "2g"),
        (
            {"kind": "instance", "mig_profile": "3g", "isolation": "dedicated-mig"},
            "mig-dedicated",
            "3g",
        ),
        ({"kind": "instance", "milli": 250, "gpu_memory_mib": 8192}, "mps", None),
        (
            {
                "kind": "instance",
                "milli": 250,
                "gpu_memory_mib": 8192,
                "isolation": "shared-timeslice",
            },
            "timeslice",
            None,
        ),
        ({"kind": "vm", "gpus": 4}, "vm", None),
        (
            {"kind": "vm", "gpus": 8, "isolation": "confidential-vm", "gpu_models": ["H100-80GB"]},
            "confidential-vm",
            None,
        ),
    ],
)
def test_the_tier_follows_the_request_and_the_policy(client, tenant, body, tier, profile):
    _, key = tenant
    r = _submit(client, key, **body)
    assert r.status_code == 201, r.text
    assert r.json()["tier"] == tier
    assert r.json()["shape"]["mig_profile"] == profile


def test_a_tenant_whose_policy_forbids_shared_mig_gets_dedicated_mig(client, world):
    t = world.tenant("careful", policy=["dedicated-gpu"])
    r = _submit(client, world.key(t), kind="instance", mig_profile="1g")
    assert r.status_code == 201 and r.json()["tier"] == "mig-dedicated"


@pytest.mark.parametrize(
    "policy, body, rule",
    [
        (ALL, {"kind": "vm", "mig_profile": "3g"}, "vm_needs_whole_gpus"),
        (ALL, {"kind": "vm", "gpus": 3}, "vm_gpu_count"),
        (
            ALL,
            {"kind": "instance", "mig_profile": "3g", "isolation": "confidential-vm"},
            "confidential_vm_needs_whole_gpus",
        ),
        (
            ALL,
            {"kind": "instance", "gpus": 1, "isolation": "confidential-vm"},
            "confidential_vm_is_a_vm",
        ),
        (
            ALL,
            {"kind": "vm", "gpus": 1, "isolation": "confidential-vm", "gpu_models": ["A100-80GB"]},
            "confidential_vm_unsupported_model",
        ),
        (
            ALL,
            {"kind": "instance", "gpus": 1, "isolation": "shared-mig"},
            "isolation_does_not_fit_shape",
        ),
        (
            ["dedicated-gpu", "vm"],
            {"kind": "instance", "milli": 100, "gpu_memory_mib": 1024},
            "tier_forbidden_by_tenant_policy",
        ),
        (["shared-mig"], {"kind": "vm", "gpus": 1}, "tier_forbidden_by_tenant_policy"),
        (
            ALL[:-1],
            {"kind": "vm", "gpus": 1, "isolation": "confidential-vm"},
            "tier_forbidden_by_tenant_policy",
        ),
    ],
)
def test_impossible_combinations_are_refused_naming_the_rule(client, world, policy, body, rule):
    t = world.tenant("t", policy=policy)
    r = _submit(client, world.key(t), **body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    p = r.json()
    assert (p["code"], p["rule"]) == ("isolation_rule_violated", rule)
    assert client.get("/v1/workloads", headers=auth(world.key(t))).json()["items"] == []


@pytest.mark.parametrize(
    "body, field",
    [
        ({"kind": "instance"}, "body"),
        ({"kind": "instance", "gpus": 1, "milli": 100, "gpu_memory_mib": 1}, "body"),
        ({"kind": "instance", "milli": 100}, "body"),
        ({"kind": "instance", "gpus": 1, "replicas": 2}, "body"),
        ({"kind": "instance", "gpus": 1, "topology": {"level": "rack"}}, "body"),
        ({"kind": "instance", "mig_profile": "5g"}, "body.mig_profile"),
        ({"kind": "instance", "mig_profile": "3g.71gb", "gpu_models": ["H100-80GB"]}, "body"),
        ({"kind": "instance", "gpus": 1, "gpu_models": ["Z80"]}, "body.gpu_models[0]"),
        ({"kind": "pod", "gpus": 1}, "body.kind"),
        ({"kind": "instance", "gpus": 1, "priority": "urgent"}, "body.priority"),
        ({"kind": "instance", "gpus": 1, "max_runtime_s": 0}, "body.max_runtime_s"),
        ({"kind": "instance", "gpus": 1, "colour": "red"}, "body.colour"),
        # A process run's workdir stays inside its own directory; a container's is absolute.
        ({"kind": "job", "gpus": 1, "command": ["x"], "workdir": "/etc"}, "body"),
        ({"kind": "job", "gpus": 1, "command": ["x"], "workdir": "a/../../b"}, "body"),
        ({"kind": "job", "gpus": 1, "command": ["x"], "workdir": "a b"}, "body.workdir"),
        (
            {"kind": "job", "gpus": 1, "runtime": "podman", "image": "i", "workdir": "rel"},
            "body",
        ),
        ({"kind": "vm", "gpus": 1, "image": "i", "workdir": "/x"}, "body"),
    ],
)
def test_bad_submissions_are_422_with_the_field(client, tenant, body, field):
    _, key = tenant
    r = _submit(client, key, **body)
    assert r.status_code == 422, r.text
    p = r.json()
    assert p["code"] == "validation_error"
    assert any(e["field"] == field for e in p["errors"]), p["errors"]


def test_quotas_hard_limit_refuses_at_once_and_use_is_reported(client, world, tenant):
    t, key = tenant
    op = world.key(None)
    r = client.put(
        f"/v1/admin/tenants/{t.id}/quotas",
        json={
            "quotas": [
                {
                    "gpu_model": "H100-80GB",
                    "guaranteed_milli": 8000,
                    "limit_milli": 16000,
                    "weight": 2,
                },
                {"gpu_model": "A100-80GB", "guaranteed_milli": 0, "limit_milli": 1000},
            ]
        },
        headers=auth(op),
    )
    assert r.status_code == 200, r.text
    too_big = _submit(
        client, key, kind="job", gpus=8, replicas=3, gpu_models=["H100-80GB", "A100-80GB"]
    )
    assert too_big.status_code == 422
    assert too_big.json()["code"] == "quota_limit_exceeded"
    assert too_big.json()["needed_milli"] == 24_000
    # (Two replicas of 4: the fleet's one H100 node could never hold two of 8.)
    ok = _submit(client, key, kind="job", gpus=4, replicas=2, gpu_models=["H100-80GB"])
    assert ok.status_code == 201, ok.text
    mig = _submit(client, key, kind="instance", mig_profile="1g", gpu_models=["A100-80GB"])
    assert mig.status_code == 201  # 125 milli: a 1g slice is 1/8 of a GPU, not a GPU
    mine = client.get("/v1/quotas", headers=auth(key)).json()["items"]
    assert mine == [
        {
            "gpu_model": "A100-80GB",
            "guaranteed_milli": 0,
            "limit_milli": 1000,
            "weight": 1.0,
            "used_milli": 0,
            "queued_milli": 125,
        },
        {
            "gpu_model": "H100-80GB",
            "guaranteed_milli": 8000,
            "limit_milli": 16000,
            "weight": 2.0,
            "used_milli": 0,
            "queued_milli": 8000,
        },
    ]
    assert client.get(f"/v1/admin/tenants/{t.id}/quotas", headers=auth(op)).json()["items"] == mine
    bad = client.put(
        f"/v1/admin/tenants/{t.id}/quotas",
        json={"quotas": [{"gpu_model": "H100-80GB", "guaranteed_milli": 9, "limit_milli": 8}]},
        headers=auth(op),
    )
    assert bad.status_code == 422
    # Unchanged by the refused update.
    assert client.get("/v1/quotas", headers=auth(key)).json()["items"] == mine


def test_terminate_is_a_transition_and_a_terminal_state_stays(client, tenant):
    _, key = tenant
    wid = _submit(client, key, kind="instance", gpus=1).json()["id"]
    r = client.delete(f"/v1/workloads/{wid}", headers=auth(key))
    assert r.status_code == 200 and r.json()["state"] == "terminated"
    assert r.json()["finished_at"] is not None
    # DELETE is idempotent: a repeat answers as the first did and writes nothing.
    again = client.delete(f"/v1/workloads/{wid}", headers=auth(key))
    assert again.status_code == 200 and again.json() == r.json()
    ev = _events(client, key, wid)
    assert [e["to_state"] for e in ev] == ["pending", "queued", "terminated"]
    assert ev[-1]["reason"] == "terminated by the customer"


def test_checkpoints_are_reported_only_while_running(client, tenant, session):
    from app.models.workloads import Workload
    from app.scheduling import lifecycle
    from app.scheduling.lifecycle import State

    _, key = tenant
    wid = _submit(client, key, kind="instance", gpus=1).json()["id"]
    r = client.post(f"/v1/workloads/{wid}/checkpoints", json={"size_bytes": 10}, headers=auth(key))
    assert r.status_code == 409 and r.json()["code"] == "workload_not_running"
    w = session.get(Workload, __import__("uuid").UUID(wid))
    for to in (State.placing, State.provisioning, State.running):
        lifecycle.transition(session, w, to, "test")
    session.commit()
    r = client.post(f"/v1/workloads/{wid}/checkpoints", json={"size_bytes": 123}, headers=auth(key))
    assert r.status_code == 201, r.text
    assert (r.json()["kind"], r.json()["to_state"]) == ("checkpoint", "running")
    got = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
    assert got["last_checkpoint_at"] is not None and got["started_at"] is not None
    future = client.post(
        f"/v1/workloads/{wid}/checkpoints",
        json={"size_bytes": 1, "completed_at": "2999-01-01T00:00:00Z"},
        headers=auth(key),
    )
    assert future.status_code == 422 and future.json()["code"] == "checkpoint_in_future"

    # Steps never go back: step 1 after step 9 is refused and the resume point stays at 9.
    def report(step: int, uri: str):
        body = {"size_bytes": 1, "step": step, "uri": uri}
        return client.post(f"/v1/workloads/{wid}/checkpoints", json=body, headers=auth(key))

    assert report(9, "s3://ckpt/step-9").status_code == 201
    behind = report(1, "s3://evil/step-1")
    assert behind.status_code == 409, behind.text
    assert (behind.json()["code"], behind.json()["resume_step"]) == ("checkpoint_step_behind", 9)
    got = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
    assert (got["last_checkpoint_step"], got["last_checkpoint_uri"]) == (9, "s3://ckpt/step-9")
    assert report(9, "s3://ckpt/step-9-again").status_code == 201  # the same step: taken
    assert report(10, "s3://ckpt/step-10").status_code == 201
    got = client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()
    assert got["last_checkpoint_step"] == 10


def test_idempotency_key_makes_one_workload(client, tenant):
    _, key = tenant
    h = {**auth(key), "Idempotency-Key": "submit-1"}
    a = client.post("/v1/workloads", json={"kind": "instance", "gpus": 2}, headers=h)
    b = client.post("/v1/workloads", json={"kind": "instance", "gpus": 2}, headers=h)
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] == b.json()["id"]
    assert len(client.get("/v1/workloads", headers=auth(key)).json()["items"]) == 1


def test_lists_are_the_tenants_own_and_filter(client, world, tenant):
    _, key = tenant
    other = world.tenant("other", policy=ALL)
    okey = world.key(other)
    mine = _submit(client, key, kind="vm", gpus=1).json()["id"]
    _submit(client, key, kind="instance", gpus=1)
    _submit(client, okey, kind="instance", gpus=1)
    vms = client.get("/v1/workloads?kind=vm", headers=auth(key)).json()["items"]
    assert [w["id"] for w in vms] == [mine]
    assert len(client.get("/v1/workloads?state=queued", headers=auth(key)).json()["items"]) == 2
    assert client.get(f"/v1/workloads/{mine}", headers=auth(okey)).status_code == 404


def test_the_region_is_chosen_or_checked_and_impossible_models_are_refused(client, tenant):
    _, key = tenant
    a100 = _submit(client, key, kind="instance", gpus=1, gpu_models=["A100-80GB"])
    assert a100.status_code == 201 and a100.json()["region"] == "r2"
    anyw = _submit(client, key, kind="instance", gpus=1)
    assert anyw.json()["region"] == "r1"  # the region with the most GPUs
    for body in (
        {"gpu_models": ["B200"]},
        {"gpu_models": ["A100-80GB"], "region": "r1"},
        {"region": "mars"},
    ):
        r = _submit(client, key, kind="instance", gpus=1, **body)
        assert r.status_code == 422 and r.json()["code"] == "no_matching_capacity", r.text


def test_a_submission_whose_commit_fails_is_refused_and_not_stored(client, tenant, monkeypatch):
    """The answer comes after the COMMIT: a commit that fails is the client's error to see
    (FastAPI ends a yield dependency only after the response is sent, so the session is
    committed by the endpoint itself, app/core/routing.py)."""
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    _, key = tenant
    assert client.get("/v1/workloads", headers=auth(key)).status_code == 200  # key checked

    def commit(self):
        raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection"))

    with monkeypatch.context() as m:
        m.setattr(Session, "commit", commit)
        r = _submit(client, key, kind="instance", gpus=1, max_runtime_s=60)
    assert r.status_code == 503 and r.json()["code"] == "dependency_unavailable", r.text
    assert client.get("/v1/workloads", headers=auth(key)).json()["items"] == []


@pytest.mark.parametrize(
    "body, says",
    [
        # 40 x 8 B200 on a fleet of 16 B200s: the example.
        (
            {"kind": "job", "gpus": 8, "replicas": 40, "gpu_models": ["B200"]},
            "the B200 nodes here hold at most 2 replicas of 8 GPU(s)",
        ),
        # Any model: said in words (it was "the fleet's any model here holds at most").
        ({"kind": "job", "gpus": 8, "replicas": 40}, "the nodes here hold at most 4 replicas"),
        ({"kind": "instance", "gpus": 16, "gpu_models": ["H100-80GB"]}, "has 16 GPUs"),
        # 80 GB200 GPUs in one NVLink domain of 72.
        (
            {
                "kind": "job",
                "gpus": 4,
                "replicas": 20,
                "gpu_models": ["GB200"],
                "topology": {"level": "nvlink_domain", "mode": "required"},
            },
            "no nvlink domain holds 20",
        ),
        (
            {"kind": "vm", "gpus": 8, "gpu_models": ["GB200"], "isolation": "confidential-vm"},
            "has 8 GPUs",
        ),
    ],
)
def test_what_the_fleet_could_never_hold_is_refused_at_submission(client, world, body, says):
    world.fleet(
        """
regions:
  - name: big
    racks:
      - {name: nvl-1, kind: nvl72, block: s1}
      - {name: nvl-2, kind: nvl72, block: s1}
      - name: b200
        kind: hgx
        gpu_model: B200
        nodes: [{name: b1}, {name: b2}]
      - name: h100
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: h1}]
      - name: a100
        kind: hgx
        gpu_model: A100-80GB
        nodes: [{name: a1}]
"""
    )
    t = world.tenant("big-co", policy=[*ALL])
    key = world.key(t)
    r = _submit(client, key, region="big", **body)
    assert r.status_code == 422, r.text
    p = r.json()
    assert p["code"] == "does_not_fit_fleet" and says in p["reason"], p
    assert client.get("/v1/workloads", headers=auth(key)).json()["items"] == []
    # What fits is accepted.
    ok = _submit(client, key, region="big", kind="job", gpus=8, replicas=2, gpu_models=["B200"])
    assert ok.status_code == 201, ok.text
