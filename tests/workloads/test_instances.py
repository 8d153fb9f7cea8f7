"""Instances one logs into, end to end (issue 44 §3 and §4): a container instance and a VM
instance launched through `POST /v1/workloads` with a tenant's registered SSH key, on a real
agent (root, podman with runc, QEMU) against a real API and Celery worker on PostgreSQL and
Redis (rackplane_bench/instances.py's host, which `rackplane bench instances` times).

The tenant logs in with its key and runs a command; another tenant's key and an unregistered
one are refused; the console (a container's output, a VM's serial console) is read through
the logs route; a terminate powers the instance down within its grace (the VM through its
power button, not a kill) and its usage ends then. Then tenant A's instances try the escapes
of §4 against tenant B's instance and the node, over SSH, and each attempt fails.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from rackplane_bench import instances, vmguest
from rackplane_bench.instances import CDI_ENV, SSH_PORTS, InstanceHost, processes_of
from tests.fixtures.world import wait_until

WHY = instances.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no instances here: {WHY}")


@pytest.fixture(scope="module")
def host():
    h = InstanceHost()
    yield h
    h.close()


def _usage_stops(host: InstanceHost, workload_id: str) -> list[datetime]:
    engine = sa.create_engine(host.dep.env["DATABASE_URL"])
    try:
        with engine.connect() as c:
            rows = c.execute(
                sa.text(
                    "SELECT occurred_at FROM usage_events WHERE workload_id = :w AND kind = 'stop'"
                ),
                {"w": uuid.UUID(workload_id)},
            )
            return [r[0] for r in rows]
    finally:
        engine.dispose()


@pytest.mark.parametrize("runtime", ["podman", "vm"])
def test_an_instance_from_the_api_is_one_the_tenant_logs_into(host, runtime):
    a, b = host.tenants["a"], host.tenants["b"]
    extra = {}
    if runtime == "podman":  # its output is its console: it says which GPU CDI gave it
        extra = {"command": ["sh", "-c", f'echo "gpu=${CDI_ENV}"; exec sleep infinity']}
    la = host.wait_ssh(host.launch(a, runtime, **extra))

    # How to connect, in the API: the node's address and a port of the agent's range.
    c = la.connect
    assert c["host"] == "127.0.0.1" and SSH_PORTS[0] <= c["port"] <= SSH_PORTS[1], c
    assert c["command"] == f"ssh -p {c['port']} root@127.0.0.1" and c["ready"], c
    w = host.get(la)
    assert w["state"] == "running" and w["runtime"] == runtime
    # The keys it was launched with (a key deleted later stays on the instance, as on a cloud).
    pub = a.ssh_key.with_suffix(".pub").read_text().split()
    assert w["ssh_keys"] == [" ".join(pub[:2])], w["ssh_keys"]
    assert any(e.startswith("ready") for e in host.events(la))

    # The tenant's key logs in as root and runs a command; B's and a stranger's are refused.
    got = host.ssh(la, a.ssh_key, "id -u; id -un; echo hello-from-$(hostname)")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split()[:2] == ["0", "root"] and "hello-from-" in got.stdout
    for key in (b.ssh_key, host.stranger):
        refused = host.ssh(la, key, "id")
        assert refused.returncode == 255 and "Permission denied (publickey" in refused.stderr, (
            refused.stdout,
            refused.stderr,
        )

    # The console, through the logs route.
    if runtime == "vm":
        wait_until(lambda: vmguest.UP_MARKER in host.logs(la), timeout=15)
        assert f"hostname=rp-{la.id} keys=1" in host.logs(la)
    else:
        gpu = host.gpus[w["placement"][0]["gpu_indices"][0]]
        wait_until(lambda: "RACKPLANE-SSH-HOSTKEY SHA256:" in host.logs(la), timeout=15)
        wait_until(lambda: f"gpu={gpu}" in host.logs(la), timeout=15)  # its GPU, by CDI

    # Terminate: powered down (the VM by its power button) within the grace, usage ends then.
    before = datetime.now(UTC)
    gone_s = host.terminate(la, timeout=40)
    gone_at = datetime.now(UTC)
    assert gone_s < 30, gone_s
    assert host.ssh(la, a.ssh_key, "true", timeout=10).returncode == 255
    if runtime == "vm":
        wait_until(lambda: vmguest.BUTTON_MARKER in host.logs(la), timeout=15)
    assert host.get(la)["state"] == "terminated" and host.get(la)["connect"] is None
    stops = wait_until(lambda: _usage_stops(host, la.id), timeout=15)
    assert len(stops) == 1, stops
    assert before - timedelta(seconds=1) <= stops[0] <= gone_at + timedelta(seconds=1), (
        stops,
        before,
        gone_at,
    )
    assert not processes_of(la.id)


def test_a_tenants_instances_cannot_reach_the_node_or_another_tenant(host):
    found = instances.escapes(host)
    assert found["escapes"] == 0, found["leaked"]
    probes = found["probes"]
    assert set(probes) == {"podman", "vm", "api"}
    for runtime in ("podman", "vm"):
        p = probes[runtime]
        # Neither the agent's state nor other runs' directories exist in the instance.
        for name in ("credential", "credential_relative", "state_dir", "other_runs"):
            assert "No such file or directory" in p[name][1], (runtime, name, p[name])
        # B's instance, by its address on B's network and by its SSH port on the node.
        for name in ("other_tenant_ssh", "other_tenant_port"):
            detail = p[name][1]
            assert "timed out" in detail or "Connection refused" in detail, (runtime, name, p)
        assert p["environ_scan"] == ("refused", "none")
        for name in ("b_key", "stranger_key"):
            assert "Permission denied (publickey" in p[name][1], (runtime, name, p[name])
    # The container's path to B's container is dropped by the wall (no answer at all).
    assert probes["podman"]["other_tenant_ssh"][1] == "nc: timed out"
    assert probes["api"] == {k: ("refused", "404") for k in ("workload", "logs", "events")}
    assert found["attempts"] == 2 * 9 + 3
