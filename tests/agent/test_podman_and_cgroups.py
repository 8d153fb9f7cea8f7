"""Pure pieces: podman's command line, cgroup v2 limits and their detection, output chunks."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rackplane_agent import cgroups, logs, runtimes
from rackplane_agent.runtimes import sshbundle
from rackplane_agent.runtimes.podman import (
    ENV_FD,
    PodmanRuntime,
    container_name,
    podman_argv,
    tenant_network,
    wall_leads,
)
from rackplane_agent.runtimes.process import resolve_command
from tests.fixtures.agent import GPU0, MIG0, assignment

pytestmark = pytest.mark.no_db


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
    assert "--workdir" not in argv  # the image's own
    there = podman_argv(assignment("w2", ["make"], runtime="podman", image="img", workdir="/src"))
    assert there[there.index("--workdir") + 1] == "/src" and there.index("--workdir") < there.index(
        "--"
    )


KEYS = [
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice",
    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY= bob",
]


def test_podman_argv_for_an_instance_one_logs_into():
    a = assignment(
        "wl-2", ["sleep", "infinity"], runtime="podman", image="img", tenant="t-0001",
        ssh_keys=KEYS, ssh_port=22007,
    )  # fmt: skip
    bundle = Path("/var/lib/rackplane-agent/ssh-bundle/0123456789abcdef")
    argv = podman_argv(a, ssh_bundle=bundle)
    # The boundary is the same; on top of it, the SSH server's few needs.
    assert {"--userns=auto:size=65536", "no-new-privileges", "--init"} <= set(argv)
    assert argv[argv.index("--cap-drop") + 1] == "all"
    assert argv[argv.index("--cap-add") + 1] == "SETUID,SETGID"
    assert argv[argv.index("--user") + 1] == "0:0"
    assert argv[argv.index("--volume") + 1] == f"{bundle}:/.rackplane/ssh:ro"
    assert argv[argv.index("--sysctl") + 1] == "net.ipv4.ip_unprivileged_port_start=22"
    assert argv[argv.index("--publish") + 1] == "22007:22/tcp"
    assert argv[argv.index("--network") + 1] == tenant_network("t-0001")
    assert argv[argv.index("--env") + 1] == "RACKPLANE_SSH_KEYS=" + "\n".join(KEYS)
    assert argv[argv.index("--") :] == ["--", "img", "/.rackplane/ssh/init", "sleep", "infinity"]
    # None of it without keys (an assignment's ssh_port alone does nothing).
    plain = podman_argv(a.model_copy(update={"ssh_keys": []}), ssh_bundle=bundle)
    assert not {"--cap-add", "--user", "--volume", "--publish", "--sysctl"} & set(plain)
    assert plain[-3:] == ["img", "sleep", "infinity"]
    # Refused: no tenant (no network to publish on), no bundle, no port, an unsafe path.
    for update, words in [
        ({"tenant": None}, "needs a tenant"),
        ({"ssh_port": None}, "no SSH port"),
    ]:
        with pytest.raises(runtimes.StartError, match=words):
            podman_argv(a.model_copy(update=update), ssh_bundle=bundle)
    with pytest.raises(runtimes.StartError, match="cannot bring an SSH server"):
        podman_argv(a)
    with pytest.raises(runtimes.StartError, match="holds a"):
        podman_argv(a, ssh_bundle=Path("/x:y"))
    big = [KEYS[0][:-5] + f"k{i:04d}" + " " + "c" * 15_000 for i in range(9)]
    with pytest.raises(runtimes.StartError, match="SSH keys take 13"):
        podman_argv(a.model_copy(update={"ssh_keys": big}), ssh_bundle=bundle)


def test_a_podman_without_dropbear_neither_offers_ssh_nor_starts_an_instance(tmp_path, monkeypatch):
    a = assignment("wl-3", ["true"], runtime="podman", image="img", tenant="t", ssh_keys=KEYS)
    monkeypatch.setattr(sshbundle, "DROPBEAR", str(tmp_path / "none"))
    empty = tmp_path / "bin"
    empty.mkdir()
    (empty / "podman").write_text("#!/bin/sh\n")
    (empty / "podman").chmod(0o755)
    monkeypatch.setattr(sshbundle, "_SEARCH", str(empty))
    rt = PodmanRuntime({"PATH": str(empty)}, ssh_dir=tmp_path / "ssh-bundle")
    assert rt.capabilities() == []
    with pytest.raises(runtimes.StartError, match="dropbear not installed"):
        rt.check(a)
    rt.check(a.model_copy(update={"ssh_keys": []}))  # a plain container still starts
    # A runtime given no place for the bundle cannot either.
    assert PodmanRuntime({"PATH": str(empty)}).capabilities() == []


def test_ldd_output_is_read_for_libraries_and_the_loader():
    text = (
        "\tlinux-vdso.so.1 (0x00007ffd)\n"
        "\tlibtomcrypt.so.1 => /lib/x86_64-linux-gnu/libtomcrypt.so.1 (0x00007f24a84ea000)\n"
        "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f24a828f000)\n"
        "\t/lib64/ld-linux-x86-64.so.2 (0x00007f24a860b000)\n"
    )
    libs, loader = sshbundle.parse_ldd(text)
    assert libs == {
        "libtomcrypt.so.1": "/lib/x86_64-linux-gnu/libtomcrypt.so.1",
        "libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
    }
    assert loader == "/lib64/ld-linux-x86-64.so.2"
    with pytest.raises(runtimes.StartError, match="cannot find libz.so.1"):
        sshbundle.parse_ldd("\tlibz.so.1 => not found\n")


@pytest.mark.skipif(
    not (os.path.exists(sshbundle.DROPBEAR) and shutil.which("dropbearkey")),
    reason="no dropbear on this host (scripts/ensure-podman.sh installs dropbear-bin)",
)
def test_the_ssh_bundle_carries_dropbear_its_libraries_and_loader(tmp_path):
    bundle = sshbundle.SshBundle(tmp_path / "ssh-bundle")
    assert bundle.missing() == []
    d = bundle.ensure()
    assert d.parent == tmp_path / "ssh-bundle" and len(d.name) == 16
    names = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}
    assert {"init", "dropbear", "dropbearkey", "ld.so", "lib/libc.so.6"} <= names, names
    for name in ("init", "dropbear", "dropbearkey", "ld.so"):
        assert (d / name).stat().st_mode & 0o777 == 0o755, name
    assert (d / "lib" / "libc.so.6").stat().st_mode & 0o777 == 0o644
    assert d.stat().st_mode & 0o777 == 0o755 and d.parent.stat().st_mode & 0o777 == 0o755
    init = (d / "init").read_text()
    assert init.startswith("#!/bin/sh\n") and 'exec "$@"' in init
    assert "$b/ld.so --library-path $b/lib $b/dropbear -s -E -p 22" in init
    assert subprocess.run(["sh", "-n", str(d / "init")]).returncode == 0
    # The bundled dropbearkey runs through the bundled loader and libraries alone.
    key = tmp_path / "key"
    made = subprocess.run(
        [d / "ld.so", "--library-path", d / "lib", d / "dropbearkey", "-t", "ed25519", "-f", key],
        capture_output=True, text=True, env={},
    )  # fmt: skip
    assert made.returncode == 0 and "Fingerprint:" in made.stdout, made
    # Built once: the same directory again, untouched.
    mtime = (d / "init").stat().st_mtime_ns
    assert bundle.ensure() == d and (d / "init").stat().st_mtime_ns == mtime
    # What went in changed (here: an older bundle lying about): only the newest two are kept.
    for i, old in enumerate(["a" * 16, "b" * 16]):
        (tmp_path / "ssh-bundle" / old).mkdir()
        os.utime(tmp_path / "ssh-bundle" / old, (1000 + i, 1000 + i))
    shutil.rmtree(d)
    again = bundle.ensure()
    assert again == d and (d / "init").is_file()
    assert sorted(p.name for p in (tmp_path / "ssh-bundle").iterdir()) == sorted([d.name, "b" * 16])


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
