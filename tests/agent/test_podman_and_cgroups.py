"""Pure pieces: podman's command line, cgroup v2 limits and their detection, output chunks."""

from __future__ import annotations

import logging

import pytest

from rackplane_agent import cgroups, logs, runtimes
from rackplane_agent.runtimes.podman import (
    ENV_FD,
    container_name,
    podman_argv,
    tenant_network,
    wall_leads,
)
from rackplane_agent.runtimes.process import resolve_command
from tests.agent.helpers import GPU0, MIG0, assignment


def test_podman_argv():
    a = assignment(
        "wl-1",
        ["python", "train.py", "--steps", "10"],
        runtime="podman",
        image="registry.example/train:1",
        attempt=2,
        replica=1,
        devices=[GPU0, MIG0],
        env={"RANK": "1", "RACKPLANE_TOKEN": "secret"},
        cpu_milli=2500,
        memory_mib=4096,
        grace_s=12.5,
        tenant="t-0001",
    )
    network = tenant_network("t-0001")
    assert podman_argv(a) == [
        "podman", "run", "--rm", "--name", "rp-wl-1-2-1",
        "--label", "rackplane.workload=wl-1",
        "--label", "rackplane.attempt=2",
        "--label", "rackplane.replica=1",
        "--label", "rackplane.tenant=t-0001",
        "--device", f"nvidia.com/gpu={GPU0}",
        "--device", f"nvidia.com/gpu={MIG0}",
        "--env-file", f"/dev/fd/{ENV_FD}",
        "--userns=auto:size=65536",
        "--security-opt", "no-new-privileges",
        "--cap-drop", "all",
        "--init",
        "--pids-limit", "16384",
        "--network", network,
        "--pull", "missing",
        "--cpus", "2.5", "--memory", "4096m",
        "--stop-timeout", "13",
        "--", "registry.example/train:1", "python", "train.py", "--steps", "10",
    ]  # fmt: skip
    assert "secret" not in " ".join(podman_argv(a))  # values go on a pipe, never in argv


def test_podman_argv_minimal_and_refusals():
    a = assignment("w/1 x", [], runtime="podman", image="img", env={})
    argv = podman_argv(a)
    assert argv[-2:] == ["--", "img"] and "--cpus" not in argv and "--memory" not in argv
    assert container_name(a) == "rp-w_1_x-0-0"
    # No tenant: no network at all, and no tenant label. The boundary is there all the same.
    assert argv[argv.index("--network") + 1] == "none"
    assert not [x for x in argv if x.startswith("rackplane.tenant")]
    assert {"--userns=auto:size=65536", "no-new-privileges", "--init"} <= set(argv)
    assert argv[argv.index("--cap-drop") + 1] == "all"
    assert "--read-only" not in argv  # the wire cannot ask for it yet


def test_tenant_networks_are_named_by_a_digest():
    a, b = tenant_network("t-0001"), tenant_network("t-0002")
    assert a is not None and b is not None and a != b
    assert a == tenant_network("t-0001") and len(a) == len("rp-tenant-") + 16
    assert a.startswith("rp-tenant-") and "t-0001" not in a
    assert tenant_network(None) is None


def test_the_tenant_wall_must_come_before_any_accept_in_forward():
    wall, iso = "-A FORWARD -j RACKPLANE_TENANT_WALL", "-A FORWARD -j NETAVARK_ISOLATION_1"
    netavark = (
        '-A FORWARD -m comment --comment "netavark firewall plugin rules" -j NETAVARK_FORWARD'
    )
    assert wall_leads([wall, netavark])
    assert wall_leads([iso, wall, netavark])  # netavark puts its isolation jump on top
    assert not wall_leads([netavark, wall])  # an ACCEPT could come first: insert again on top
    assert not wall_leads([iso, netavark]) and not wall_leads([])
    assert not wall_leads(["-A FORWARD -j ACCEPT", wall])
    with pytest.raises(runtimes.StartError, match="image"):
        podman_argv(assignment("w", ["x"], runtime="podman"))


def test_runtimes_offered():
    assert runtimes.available(["process"]) == ["process"]
    assert "process" in runtimes.available()
    import shutil

    if shutil.which("podman") is None:
        with pytest.raises(ValueError, match="podman"):
            runtimes.available(["podman"])


def test_resolve_command(tmp_path):
    assert resolve_command("sh", "/usr/bin:/bin", tmp_path).endswith("/sh")
    with pytest.raises(runtimes.StartError, match="not found"):
        resolve_command("no-such-binary-x", "/usr/bin:/bin", tmp_path)
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(runtimes.StartError, match="not executable"):
        resolve_command("./run.sh", "/bin", tmp_path)
    script.chmod(0o755)
    assert resolve_command("./run.sh", "/bin", tmp_path) == f"{tmp_path}/./run.sh"


def test_cgroup_limits():
    assert cgroups.limits(1500, 2048) == {"memory.max": "2147483648", "cpu.max": "150000 100000"}
    assert cgroups.limits(0, 0) == {"memory.max": "max", "cpu.max": "max 100000"}
    assert cgroups.limits(5, 1)["cpu.max"] == "1000 100000"  # the kernel's floor
    assert cgroups.limits(64000, 0)["cpu.max"] == "6400000 100000"


def test_cgroup_detection_on_fake_trees(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rackplane_agent")
    proc = tmp_path / "self-cgroup"
    root = tmp_path / "cg"
    root.mkdir()
    # cgroup v1 (no cgroup.controllers at the root): unavailable, said once.
    proc.write_text("4:memory:/x\n0::/\n")
    c = cgroups.Cgroups(root, proc)
    assert c.available() is False and c.available() is False and c.create("r", 1, 1) is None
    assert caplog.text.count("cgroup_limits_unavailable") == 1
    # v2, delegated: the run's cgroup with its limits.
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    base = root / "agent.service"
    base.mkdir()
    (base / "cgroup.subtree_control").write_text("")
    proc.write_text("0::/agent.service\n")
    c = cgroups.Cgroups(root, proc)
    path = c.create("w1.0.0", 500, 256)
    assert path == str(base / "rackplane-w1.0.0")
    assert (base / "cgroup.subtree_control").read_text() == "+memory +cpu"
    assert (base / "rackplane-w1.0.0" / "memory.max").read_text() == str(256 * 1024 * 1024)
    assert (base / "rackplane-w1.0.0" / "cpu.max").read_text() == "50000 100000"


def test_output_chunks_keep_utf8_whole(tmp_path):
    out = tmp_path / "output.log"
    text = "é" * 100  # 200 bytes
    out.write_bytes(text.encode() + "€".encode()[:2])  # a character still being written
    chunks = logs.read_chunks(out, 0, final=False, max_bytes=10_000, chunk=33)
    assert [len(d) for _, d in chunks] == [32] * 6 + [8]  # cut before the half character
    assert "".join(logs.decode(d) for _, d in chunks) == text
    assert [o for o, _ in chunks] == [sum(len(d) for _, d in chunks[:i]) for i in range(7)]
    # Once the run is over, the rest goes as it is.
    rest = logs.read_chunks(out, 200, final=True, max_bytes=10_000)
    assert rest == [(200, "€".encode()[:2])] and logs.decode(rest[0][1]) == "\ufffd"
    assert logs.read_chunks(out, 200, final=False, max_bytes=10_000) == []
    assert (
        logs.utf8_complete(b"ab\xf0\x9f\x98") == 2 and logs.utf8_complete(b"\xf0\x9f\x98\x80") == 4
    )


def test_tail(tmp_path):
    out = tmp_path / "output.log"
    out.write_text("".join(f"line {i}\n" for i in range(100)) + "z" * 900)
    got = logs.tail(out)
    assert len(got) == 20 and got[0] == "line 81" and got[-1] == "z" * 500
    assert logs.tail(tmp_path / "missing") == []
