"""Placement on real PostgreSQL, Redis and a Celery worker process: submissions reach `running`
on the simulated provider, preemption checkpoints then requeues, termination releases; and the
database itself refuses double allocation."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from tests.fixtures.workloads import ALL, fleet, running, state
from tests.fixtures.world import auth, wait_until


def _states(client, key, wid):
    ev = client.get(f"/v1/workloads/{wid}/events", headers=auth(key)).json()["items"]
    return [e["to_state"] for e in ev if e["kind"] == "transition"]


# --- database guards --------------------------------------------------------------------------


@pytest.fixture
def held(world, client, session):
    """A one-node fleet and a (terminated, so no worker places it) workload to hang
    hand-written allocations on."""
    from app.models.fleet import Node

    world.fleet(fleet(1))
    t = world.tenant("acme", policy=ALL)
    key = world.key(t)
    wid = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
    wid = wid.json()["id"]
    assert client.delete(f"/v1/workloads/{wid}", headers=auth(key)).status_code == 200
    node = session.scalar(select(Node))
    return t, uuid.UUID(wid), node


def _alloc(session, held, gpus, *, milli=1000, mig=None, start=None, mem=0):
    from app.models.workloads import Allocation
    from app.scheduling.apply import claim

    t, wid, node = held
    a = Allocation(
        workload_id=wid,
        tenant_id=t.id,
        node_id=node.id,
        replica=0,
        tier="dedicated",
        gpu_indices=gpus,
        mig_profile=mig,
        mig_start=start,
        milli=milli,
        gpu_memory_mib=mem,
    )
    session.add(a)
    session.flush()
    claim(session, [(a, "H100-80GB")])
    return a


@pytest.mark.parametrize(
    "first, second",
    [
        ({"gpus": [3]}, {"gpus": [2, 3]}),  # whole GPU twice
        ({"gpus": [0]}, {"gpus": [0], "mig": "1g", "start": 6, "milli": 125}),  # MIG beside whole
        (
            {"gpus": [5], "mig": "3g", "start": 4, "milli": 500},
            {"gpus": [5], "mig": "2g", "start": 4, "milli": 250},
        ),  # overlapping MIG slices
        (
            {"gpus": [1], "milli": 600, "mem": 1000},
            {"gpus": [1], "milli": 500, "mem": 1000},
        ),  # fractional over-commit
        (
            {"gpus": [1], "milli": 100, "mem": 60_000},
            {"gpus": [1], "milli": 100, "mem": 30_000},
        ),  # GPU memory over-commit
    ],
)
def test_the_database_refuses_double_allocation(session, held, first, second):
    _alloc(session, held, **first)
    session.commit()
    with pytest.raises(IntegrityError):
        _alloc(session, held, **second)
    session.rollback()


def test_one_cycle_claiming_a_gpu_twice_is_refused(session, held):
    """A cycle claims all its allocations in one statement; two of them on one GPU sum past
    its capacity and the CHECK refuses the whole batch."""
    from app.models.workloads import Allocation
    from app.scheduling.apply import claim

    t, wid, node = held
    rows = [
        Allocation(
            workload_id=wid,
            tenant_id=t.id,
            node_id=node.id,
            replica=i,
            tier="dedicated",
            gpu_indices=[g],
            milli=1000,
            gpu_memory_mib=0,
        )
        for i, g in enumerate((2, 4, 2))
    ]
    session.add_all(rows)
    session.flush()
    with pytest.raises(IntegrityError):
        claim(session, [(a, "H100-80GB") for a in rows])
    session.rollback()


def test_mig_slices_side_by_side_and_reuse_after_release(session, held):
    from app.models.workloads import GpuUsage, MigClaim

    a = _alloc(session, held, [7], mig="3g", start=0, milli=500)
    _alloc(session, held, [7], mig="3g", start=4, milli=500)
    session.commit()
    from app.models.workloads import Workload
    from app.scheduling.apply import release

    w = session.get(Workload, a.workload_id)
    assert release(session, w) == 2
    _alloc(session, held, [7], mig="7g", start=0, milli=1000)  # the slices are free again
    session.commit()
    assert session.scalar(select(GpuUsage.milli_used).where(GpuUsage.gpu_index == 7)) == 1000
    live = select(func.count()).select_from(MigClaim).where(MigClaim.released_at.is_(None))
    assert session.scalar(live) == 8


# --- the lifecycle on a real worker -----------------------------------------------------------


def test_a_gang_and_a_mig_instance_run_and_terminate(client, world, session, celery_worker_process):
    from app.models.workloads import Allocation, GpuUsage

    world.fleet(fleet(2))
    t = world.tenant("acme", policy=ALL)
    key = world.key(t)
    gang = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 4,
            "replicas": 2,
            "gpu_models": ["H100-80GB"],
            "topology": {"level": "rack", "mode": "required"},
        },
        headers=auth(key),
    ).json()["id"]
    mig = client.post(
        "/v1/workloads", json={"kind": "instance", "mig_profile": "3g.40gb"}, headers=auth(key)
    ).json()["id"]
    g = running(client, key, gang)
    m = running(client, key, mig)
    assert _states(client, key, gang) == ["pending", "queued", "placing", "provisioning", "running"]
    assert [p["replica"] for p in g["placement"]] == [0, 1]
    assert all(p["rack"] == "hgx-1" and p["region"] == "r1" for p in g["placement"])
    assert sum(len(p["gpu_indices"]) for p in g["placement"]) == 8
    [slot] = m["placement"]
    # The slice by the name the request used (and capacity and prices use), not its key.
    assert (slot["mig_profile"], slot["gpu_milli"]) == ("3g.40gb", 500)
    assert slot["mig_slot"] in (0, 4)
    gang_gpus = {(p["node"], i) for p in g["placement"] for i in p["gpu_indices"]}
    assert (slot["node"], slot["gpu_indices"][0]) not in gang_gpus
    session.expire_all()
    assert session.scalar(select(func.sum(GpuUsage.milli_used))) == 8000 + 500
    # The quotas' held GPUs (from live allocations) are what the placements hold.
    from app.workloads.quotas import usage

    placed: dict[str, int] = {}
    for p in [*g["placement"], slot]:
        placed[p["gpu_model"]] = placed.get(p["gpu_model"], 0) + p["gpu_milli"]
    assert usage(session, t.id)[0] == placed and sum(placed.values()) == 8500
    _check_manifests(client, key, g, m)
    for wid in (gang, mig):
        r = client.delete(f"/v1/workloads/{wid}", headers=auth(key))
        assert r.status_code == 200 and r.json()["state"] == "terminated"
    session.expire_all()
    assert session.scalar(select(func.sum(GpuUsage.milli_used))) == 0
    assert (
        session.scalar(
            select(func.count()).select_from(Allocation).where(Allocation.released_at.is_(None))
        )
        == 0
    )


def _as(obj, kind: str):
    """Through the official client's own deserializer: a manifest it cannot read fails."""
    import json

    from kubernetes.client import ApiClient

    class Response:
        data = json.dumps(obj)

    return ApiClient().deserialize(Response(), kind)


def _as_pod(obj):
    return _as(obj, "V1Pod")


def _check_manifests(client, key, gang, mig):
    r = client.get(f"/v1/workloads/{gang['id']}/manifest", headers=auth(key))
    assert r.status_code == 200, r.text
    lst = r.json()
    assert (lst["apiVersion"], lst["kind"], len(lst["items"])) == ("v1", "List", 3)
    service, *items = lst["items"]
    svc = _as(service, "V1Service")
    base = svc.metadata.name
    assert svc.spec.cluster_ip == "None" and svc.spec.ports[0].port == 29500
    assert svc.spec.selector == {"rackplane.dev/workload": gang["id"]}
    master = f"{base}-0.{base}.tenant-acme.svc.cluster.local"
    for i, (item, p) in enumerate(zip(items, gang["placement"], strict=True)):
        pod = _as_pod(item)
        # Distributed training: torchrun's, JAX's and plain ranks, the rendezvous, topology.
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        per = len(p["gpu_indices"])
        assert (pod.spec.hostname, pod.spec.subdomain) == (f"{base}-{i}", base)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (master, "29500")
        assert env["WORLD_SIZE"] == str(2 * per) and env["LOCAL_WORLD_SIZE"] == str(per)
        assert env["RANK"] == str(i * per) and env["LOCAL_RANK"] == "0"
        assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == (
            "2",
            str(i),
            str(per),
        )
        assert env["JAX_PROCESS_ID"] == str(i) and env["JAX_NUM_PROCESSES"] == "2"
        assert env["RACKPLANE_NODE"] == p["node"] and env["RACKPLANE_RACK"] == p["rack"]
        assert env["RACKPLANE_NVLINK_DOMAIN"] == f"r1/hgx-1/{p['node']}"
        assert pod.spec.resource_claims is None  # HGX: no multi-node NVLink domain
        assert pod.spec.node_selector == {"kubernetes.io/hostname": p["node"]}
        limits = pod.spec.containers[0].resources.limits
        assert limits == {"nvidia.com/gpu": "4"}
        assert pod.metadata.labels["rackplane.dev/tenant"] == "acme"
        assert pod.metadata.labels["rackplane.dev/tier"] == "dedicated"
        assert pod.metadata.annotations["rackplane.dev/gpu-indices"] == ",".join(
            map(str, p["gpu_indices"])
        )
        assert {"name": "RACKPLANE_RANK", "value": str(i)} in item["spec"]["containers"][0]["env"]
        assert pod.spec.restart_policy == "Never" and pod.metadata.namespace == "tenant-acme"
    pod = _as_pod(client.get(f"/v1/workloads/{mig['id']}/manifest", headers=auth(key)).json())
    assert pod.spec.containers[0].resources.limits == {"nvidia.com/mig-3g.40gb": "1"}
    assert pod.metadata.annotations["rackplane.dev/mig-slot"] == str(
        mig["placement"][0]["mig_slot"]
    )


def test_manifests_of_vms_and_shares_and_of_unplaced_work(client, world, celery_worker_process):
    world.fleet(fleet(1))
    t = world.tenant("acme", policy=ALL)
    key = world.key(t)
    vm = client.post(
        "/v1/workloads",
        json={
            "kind": "vm",
            "gpus": 2,
            "cpu_milli": 16000,
            "memory_mib": 65536,
            "image": "registry.example/vm-disk:1",
        },
        headers=auth(key),
    ).json()["id"]
    share = client.post(
        "/v1/workloads",
        json={"kind": "instance", "milli": 250, "gpu_memory_mib": 10240},
        headers=auth(key),
    ).json()["id"]
    running(client, key, vm)
    running(client, key, share)
    pod = _as_pod(client.get(f"/v1/workloads/{vm}/manifest", headers=auth(key)).json())
    assert pod.spec.runtime_class_name == "kata-qemu-nvidia-gpu"
    assert pod.spec.containers[0].image == "registry.example/vm-disk:1"
    assert pod.spec.containers[0].resources.limits == {
        "nvidia.com/gpu": "2",
        "cpu": "16000m",
        "memory": "65536Mi",
    }
    pod = _as_pod(client.get(f"/v1/workloads/{share}/manifest", headers=auth(key)).json())
    assert pod.spec.containers[0].resources.limits == {"nvidia.com/gpu.shared": "1"}
    assert pod.metadata.annotations["rackplane.dev/gpu-milli"] == "250"
    client.delete(f"/v1/workloads/{vm}", headers=auth(key))
    r = client.get(f"/v1/workloads/{vm}/manifest", headers=auth(key))
    assert r.status_code == 409 and r.json()["code"] == "workload_not_placed"


def test_preemption_checkpoints_then_requeues_and_resumes(client, world, celery_worker_process):
    world.fleet(fleet(1))
    a, b = world.tenant("a", policy=ALL), world.tenant("b", policy=ALL)
    ka, kb = world.key(a), world.key(b)
    low = client.post(
        "/v1/workloads",
        json={
            "kind": "instance",
            "gpus": 8,
            "priority": "preemptible",
            "checkpoint": {"interval_s": 600, "cost_s": 0},
        },
        headers=auth(ka),
    ).json()["id"]
    running(client, ka, low)
    r = client.post(f"/v1/workloads/{low}/checkpoints", json={"size_bytes": 10}, headers=auth(ka))
    assert r.status_code == 201
    high = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 8, "priority": "production"},
        headers=auth(kb),
    ).json()["id"]
    running(client, kb, high)
    back = wait_until(lambda: (w := state(client, ka, low))["state"] == "queued" and w)
    assert back["preemptions"] == 1 and back["placement"] is not None
    assert _states(client, ka, low)[-4:] == ["running", "checkpointing", "preempted", "queued"]
    requeued = client.get(f"/v1/workloads/{low}/events", headers=auth(ka)).json()["items"][-1]
    assert requeued["details"]["resumes_from"] == "checkpoint"
    assert requeued["reason"].startswith("requeued: resumes from its checkpoint of ")
    ev = client.get(f"/v1/workloads/{low}/events", headers=auth(ka)).json()["items"]
    why = next(e for e in ev if e["to_state"] == "checkpointing")
    assert why["details"]["reason"] == "priority" and why["details"]["by"] is None
    assert why["details"]["by_others"] == [{"priority": "production", "count": 1}]
    assert "a production workload of another tenant" in why["reason"]
    assert high not in str(ev)  # the other tenant's id is not disclosed
    placed = client.get(f"/v1/workloads/{high}/events", headers=auth(kb)).json()["items"]
    admitted = next(e for e in placed if e["to_state"] == "placing")
    assert admitted["details"]["victims"] == [] and low not in str(placed)
    assert admitted["details"]["victims_others"] == [{"priority": "preemptible", "count": 1}]
    # The system's actions are in A's audit log, without B's id; operators see who preempted.
    log = client.get("/v1/audit", params={"target_id": low}, headers=auth(ka)).json()["items"]
    actions = [e["action"] for e in log if e["principal"] == "system"]
    assert actions == ["workload.preempt", "workload.requeue"] and high not in str(log)
    op = world.key(None)
    full = client.get(
        "/v1/admin/audit", params={"action": "workload.preempt"}, headers=auth(op)
    ).json()["items"]
    assert [e["internal"]["by"] for e in full] == [high]
    client.delete(f"/v1/workloads/{high}", headers=auth(kb))
    running(client, ka, low)  # resumes on the freed GPUs


def test_defragment_moves_small_work_so_a_whole_node_job_starts(
    client, world, celery_worker_process
):
    """Two nodes, each with a little work and most GPUs free: an 8-GPU job of the same class
    cannot preempt anyone, yet starts once the worker moves the smaller job beside the other."""
    world.fleet(fleet(2))
    a = world.tenant("a", policy=ALL)
    ka = world.key(a)

    def submit(gpus):
        body = {
            "kind": "instance",
            "gpus": gpus,
            "priority": "preemptible",
            "checkpoint": {"interval_s": 600, "cost_s": 0},
        }
        wid = client.post("/v1/workloads", json=body, headers=auth(ka)).json()["id"]
        return running(client, ka, wid)

    def node(w):
        [p] = w["placement"]
        return p["node"]

    fill = submit(7)
    s1 = submit(1)  # best fit: beside the 7
    s2 = submit(2)  # the other node
    assert node(s1) == node(fill) != node(s2)
    client.delete(f"/v1/workloads/{fill['id']}", headers=auth(ka))
    wait_until(lambda: state(client, ka, fill["id"])["state"] == "terminated")
    big = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 8, "priority": "preemptible"},
        headers=auth(ka),
    ).json()["id"]
    placed = running(client, ka, big)
    # Both moves lose nothing (instant checkpoints): the one moving fewer GPUs wins.
    assert node(placed) == node(s1)
    moved = wait_until(
        lambda: (
            (w := state(client, ka, s1["id"]))["state"] == "running" and w["preemptions"] == 1 and w
        )
    )
    assert node(moved) == node(s2)
    ev = client.get(f"/v1/workloads/{s1['id']}/events", headers=auth(ka)).json()["items"]
    why = next(e for e in ev if e["to_state"] == "checkpointing")
    assert why["details"] == why["details"] | {"by": big, "reason": "defragment"}
    assert state(client, ka, s2["id"])["preemptions"] == 0


def test_dry_run_answers_where_whom_and_when_and_writes_nothing(
    client, world, session, celery_worker_process
):
    from datetime import datetime, timedelta

    from app.models.workloads import Workload

    world.fleet(fleet(1))
    a, b = world.tenant("a", policy=ALL), world.tenant("b", policy=ALL)
    ka, kb = world.key(a), world.key(b)

    def ask(key, **body):
        r = client.post(
            "/v1/workloads:dry-run", json={"kind": "instance", **body}, headers=auth(key)
        )
        assert r.status_code == 200, r.text
        return r.json()

    empty = ask(kb, gpus=2)
    assert empty["placeable_now"] and empty["preempts"] == [] and empty["reason"] == "fits now"
    assert empty["placement"][0]["node"] == "h1" and len(empty["placement"][0]["gpu_indices"]) == 2
    low = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 8, "priority": "preemptible", "max_runtime_s": 3600},
        headers=auth(ka),
    ).json()["id"]
    low_run = running(client, ka, low)
    high = ask(kb, gpus=8, priority="production")
    # Another tenant's victim is counted, not named; one's own is named.
    assert high["placeable_now"] and high["preempts"] == [] and low not in str(high)
    assert high["preempts_others"] == [{"priority": "preemptible", "count": 1}]
    mine = ask(ka, gpus=8, priority="production")
    assert mine["preempts"] == [low] and mine["preempts_others"] == []
    start = datetime.fromisoformat(high["expected_start"])
    assert (
        timedelta(0)
        < start - datetime.fromisoformat(low_run["started_at"])
        < timedelta(seconds=120)
    )
    waits = ask(kb, gpus=8, priority="preemptible")  # equal class: must wait for the end
    assert not waits["placeable_now"] and waits["preempts"] == []
    ends = datetime.fromisoformat(low_run["started_at"]) + timedelta(seconds=3600)
    assert abs((datetime.fromisoformat(waits["expected_start"]) - ends).total_seconds()) < 2
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(Workload)) == 1
    over = client.post(
        "/v1/workloads:dry-run", json={"kind": "vm", "mig_profile": "1g"}, headers=auth(kb)
    )
    assert over.status_code == 422 and over.json()["rule"] == "vm_needs_whole_gpus"


def test_the_cached_fleet_snapshot_follows_every_fleet_change(world, session):
    """Cycles reuse a process's copy of the region's fleet while its version holds; any
    change a snapshot is built from (cordon, GPU health, MIG mode, a new node) is seen at the
    next cycle."""
    from sqlalchemy import update

    from app.models.fleet import Gpu, Node
    from app.placement.snapshot import FAILED
    from app.scheduling.world import world_of

    world.fleet(fleet(2))

    def specs():
        w = world_of(session, "r1")
        session.rollback()
        return {s.name: s for s in w.specs}

    first = specs()
    assert world_of(session, "r1").specs is world_of(session, "r1").specs  # reused
    session.rollback()
    h1 = session.scalar(select(Node.id).where(Node.name == "h1"))
    session.execute(update(Node).where(Node.id == h1).values(state="cordoned"))
    session.execute(
        update(Gpu).where(Gpu.node_id == h1, Gpu.index == 3).values(health="out_of_service")
    )
    session.execute(update(Gpu).where(Gpu.node_id == h1, Gpu.index == 5).values(mig_mode=True))
    session.commit()
    after = specs()
    assert first["h1"].schedulable and not after["h1"].schedulable
    assert after["h1"].gpu_health[3] == FAILED and after["h1"].mig_gpus == (5,)
    assert after["h2"] == first["h2"]
    world.fleet(fleet(3))
    assert set(specs()) == {"h1", "h2", "h3"}


def test_a_fleet_change_bumps_the_version_of_its_region_only(world, session):
    """The triggers behind the kept fleet: any transaction writing a region's racks, nodes or
    GPUs bumps that region's version, once however many statements it runs; other regions
    keep theirs, and a rolled-back change leaves the version as it was."""
    from sqlalchemy import delete, update

    from app.models.fleet import Gpu, Node, Rack, Region

    world.fleet(fleet(2) + fleet(1).split("regions:\n")[1].replace("r1", "r2").replace("h1", "z1"))

    def versions():
        session.rollback()
        return dict(session.execute(select(Region.name, Region.fleet_version)).all())

    def node_id(name):
        return session.scalar(select(Node.id).where(Node.name == name))

    v0 = versions()
    session.execute(update(Gpu).where(Gpu.node_id == node_id("h1")).values(health="suspect"))
    session.commit()  # a statement over 8 GPUs: one bump
    v1 = versions()
    assert v1 == {"r1": v0["r1"] + 1, "r2": v0["r2"]}
    session.execute(update(Node).where(Node.name == "z1").values(state="cordoned"))
    session.rollback()
    assert versions() == v1
    session.execute(
        update(Rack)
        .where(Rack.region_id == select(Region.id).where(Region.name == "r2").scalar_subquery())
        .values(block="spine-9")
    )
    session.execute(delete(Node).where(Node.name == "h2"))  # its GPUs go by cascade
    session.commit()
    v2 = versions()
    assert v2 == {"r1": v1["r1"] + 1, "r2": v1["r2"] + 1}  # once per region and transaction
    session.execute(update(Node).where(Node.name == "h1").values(state="cordoned"))
    session.execute(update(Gpu).where(Gpu.node_id == node_id("h1")).values(health="healthy"))
    session.commit()
    assert versions() == {"r1": v2["r1"] + 1, "r2": v2["r2"]}  # two statements, one bump


def test_the_kept_region_state_matches_a_full_read_after_every_change(
    world, client, session, monkeypatch
):
    """Cycles keep each region's snapshot between runs and bring it up to date from the
    workloads written since their last read. After placements of every shape, terminations
    through the API, provisioning, a change committed after a read that began before it, and
    a cycle that lost its plan, the kept state equals the region read in full."""
    import numpy as np
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from app.core.db import get_engine
    from app.scheduling import apply
    from app.scheduling import cycle as P
    from app.scheduling import world as region_world
    from app.workloads.tasks import check, provision

    world.fleet(fleet(2))
    t = world.tenant("kept", policy=ALL)
    key = world.key(t)

    def submit(body):
        r = client.post("/v1/workloads", json={"region": "r1", **body}, headers=auth(key))
        assert r.status_code == 201, r.text
        return r.json()["id"]

    # This test decides for the region: it holds the region's lock for its whole length (a
    # session-level lock, which its own cycles share), so a worker's cycle cannot interleave.
    decider = get_engine().connect()
    decider.execute(text("SELECT pg_advisory_lock(:k)"), {"k": P.region_lock_key("r1")})
    decider.commit()

    def cycle():
        with Session(bind=decider) as s:
            report = P.run_cycle(s, "r1")
            s.commit()
        return report

    def same():
        session.rollback()  # one database snapshot for both reads
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        kept = region_world.load(session, "r1", kept=True)
        fresh = region_world.load(session, "r1")
        assert kept is not None and fresh is not None

        def held(loaded):
            return {
                k: (
                    h.state,
                    h.generation,
                    len(h.qw.alloc_ids),
                    (h.qw.started_at, h.qw.last_checkpoint_at, h.qw.preempted_at),
                )
                for k, h in loaded.holding.items()
            }

        assert held(kept) == held(fresh)
        for attr in ("gpu_free", "gpu_mem_free", "node_cpu_free", "node_mem_free", "gpu_mig_mask"):
            assert np.array_equal(getattr(kept.world.snap, attr), getattr(fresh.world.snap, attr))
        session.rollback()
        return held(kept)

    shapes = [
        {"kind": "instance", "gpus": 1},
        {"kind": "instance", "gpus": 2},
        {"kind": "instance", "mig_profile": "1g", "isolation": "shared-mig"},
        {"kind": "instance", "milli": 300, "gpu_memory_mib": 8000},
        {"kind": "vm", "gpus": 4},
    ]
    try:
        ids = [submit(b) for b in shapes]
        assert len(cycle().admitted) == len(shapes)
        assert len(same()) == len(shapes)
        for wid in ids[:2]:
            assert client.delete(f"/v1/workloads/{wid}", headers=auth(key)).status_code == 200
        assert len(same()) == len(shapes) - 2
        provision(workload_ids=ids[2:])  # placing -> provisioning: new generations
        # -> running (started, evictable) once booted, by this check or a worker's
        wait_until(
            lambda: (
                check(workload_ids=ids[2:]) is not None
                and {h[0] for h in same().values()} == {"running"}
            ),
            timeout=15,
        )
        more = [submit(b) for b in shapes[:3]]
        assert len(cycle().admitted) == 3
        assert set(same()) == {uuid.UUID(w) for w in ids[2:] + more}

        def conflict(*_a, **_k):
            raise apply.PlanConflict("lost the race")

        # A change whose transaction began before a read of the kept state and commits after
        # it: the read cannot see it, and the next one must.
        victim = next(iter(same()))
        late = get_engine().connect()
        late.execute(
            text(
                "UPDATE workloads SET state = 'terminated', generation = generation + 1 "
                "WHERE id = :w"
            ),
            {"w": victim},
        )
        late.execute(
            text("UPDATE allocations SET released_at = now() WHERE workload_id = :w"),
            {"w": victim},
        )
        with get_engine().begin() as c:  # a younger transaction completes first
            c.execute(text("SELECT pg_current_xact_id()"))
        assert victim in same()
        late.commit()
        late.close()
        assert victim not in same()

        submit(shapes[0])
        monkeypatch.setattr(apply, "claim", conflict)  # dropped after the core allocated
        with pytest.raises(apply.PlanConflict):
            cycle()
        same()
    finally:
        decider.rollback()
        decider.execute(text("SELECT pg_advisory_unlock_all()"))  # pooled: the session lives on
        decider.commit()
        decider.close()


def test_a_cycle_that_finds_the_region_busy_hands_over_to_the_running_one(
    world, client, session, monkeypatch
):
    """Work submitted while a cycle holds the region kicks a second cycle, which finds the
    region locked. It hands over instead of polling the lock: the running cycle, once
    committed, runs again in the same task, and the work is placed."""
    import threading

    from sqlalchemy import text

    from app.models.workloads import WorkloadEvent
    from app.scheduling import cycle as P
    from app.scheduling import tasks

    world.fleet(fleet(2))
    key = world.key(world.tenant("busy", policy=ALL))

    def submit():
        r = client.post(
            "/v1/workloads", json={"region": "r1", "kind": "instance", "gpus": 1}, headers=auth(key)
        )
        assert r.status_code == 201, r.text
        return uuid.UUID(r.json()["id"])

    first = submit()
    decided, go_on = threading.Event(), threading.Event()
    real = P.run_cycle
    runs: dict[bool, list] = {True: [], False: []}  # by "is the holder"

    def holding(s, region, config=None):
        mine = runs[threading.current_thread() is holder]
        if threading.current_thread() is holder and not mine:
            # Hold the region (waiting out a cycle a worker of an earlier test may be running),
            # whether or not that worker placed `first`.
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": P.region_lock_key(region)})
            report = real(s, region, config)
            decided.set()  # decided and holding the lock, not yet committed
            assert go_on.wait(30)
        else:
            report = real(s, region, config)
        mine.append(len(report.admitted) if report.ran else "locked")
        return report

    monkeypatch.setattr(tasks, "run_cycle", holding)
    out = {}
    holder = threading.Thread(target=lambda: out.update(tasks.placement_cycle("r1")))
    holder.start()
    assert decided.wait(30)
    second = submit()
    # Called directly, a retry would raise: the busy cycle must hand over and return.
    assert tasks.placement_cycle("r1") == {"admitted": 0}
    assert runs[False] == ["locked", "locked"]  # tried, handed over, tried once more
    go_on.set()
    holder.join(30)
    # It ran again after its commit (or found a worker's cycle had the region by then, and
    # handed over to it in turn).
    assert len(runs[True]) >= 2
    assert out["admitted"] == sum(n for n in runs[True] if n != "locked")

    def placed():
        session.rollback()
        return set(
            session.scalars(
                select(WorkloadEvent.workload_id).where(WorkloadEvent.to_state == "placing")
            )
        )

    assert wait_until(lambda: placed() == {first, second}, timeout=5)


def test_a_gang_across_nvl72_trays_shares_a_compute_domain(client, world, celery_worker_process):
    """Replicas on several trays of one NVL72 rack: the ComputeDomain NVIDIA's DRA driver
    expects, and each Pod claiming its IMEX channel."""
    world.fleet("regions: [{name: r1, racks: [{name: nvl-1, kind: nvl72, block: s1}]}]")
    key = world.key(world.tenant("acme", policy=ALL))
    gang = client.post(
        "/v1/workloads",
        json={
            "kind": "job",
            "gpus": 4,
            "replicas": 2,
            "gpu_models": ["GB200"],
            "topology": {"level": "nvlink_domain", "mode": "required"},
        },
        headers=auth(key),
    ).json()
    placed = running(client, key, gang["id"])
    assert len({p["node"] for p in placed["placement"]}) == 2
    lst = client.get(f"/v1/workloads/{gang['id']}/manifest", headers=auth(key)).json()
    kinds = [i["kind"] for i in lst["items"]]
    assert kinds == ["Service", "ComputeDomain", "Pod", "Pod"]
    cd = lst["items"][1]
    assert cd["apiVersion"] == "resource.nvidia.com/v1beta1" and cd["spec"]["numNodes"] == 2
    template = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
    for item in lst["items"][2:]:
        pod = _as_pod(item)
        [claim] = pod.spec.resource_claims
        assert claim.resource_claim_template_name == template
        assert [c.name for c in pod.spec.containers[0].resources.claims] == [claim.name]
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["RACKPLANE_NVLINK_DOMAIN"] == "r1/nvl-1"


def test_gangs_whose_rank_0s_share_a_node_never_share_a_rendezvous_port(session, held):
    """Issue 46 §2: a gang's `MASTER_PORT` is chosen at placement, from the configured range,
    among the ports no other gang's replica 0 on that node holds; a new attempt moves on."""
    from app.models.workloads import Workload
    from app.scheduling.apply import give_master_ports

    _, wid, node = held
    _alloc(session, held, [0])
    session.get(Workload, wid).master_port = 31000  # a live gang's rank 0 on the node
    session.flush()
    gangs = [Workload(id=uuid.uuid4(), attempts=1) for _ in range(3)]
    give_master_ports(session, [(gangs[0], node.id), (gangs[1], node.id)], "31000-31002")
    assert sorted(g.master_port for g in gangs[:2]) == [31001, 31002]
    # Elsewhere the port is free.
    give_master_ports(session, [(gangs[2], uuid.uuid4())], "31000-31000")
    assert gangs[2].master_port == 31000
    # A new attempt takes neither a port in use nor its last one (its old rank 0 may linger).
    g = gangs[0]
    last, g.attempts = g.master_port, 2
    give_master_ports(session, [(g, node.id)], "31000-31003")
    assert g.master_port not in (31000, last) and 31000 <= g.master_port <= 31003
    session.rollback()
