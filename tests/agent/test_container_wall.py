"""The `container` tier's wall, with real containers (issue 44 §2 and §4's escape matrix).

A real agent (in this process, as root) runs tenants' workloads through its podman runtime:
rootful podman 4.3 with runc, a private configuration and storage
(rackplane_bench/containers.py), an image built here from busybox-static. A victim of tenant A
holds a secret in its env and listens on a port; an attacker of tenant B tries to read the
agent's credential, to see the victim's processes and env, to reach it over the network, and to
use capabilities; each attempt must fail, and the test asserts the failure (the error it got),
not only an empty output. A second container of tenant A reaches the victim (the wall is between
tenants, not inside one). netavark's own isolation is taken away before the probes, as netavark
1.4 takes it away itself (docs/design/containers-here.md): what holds is the runtime's own wall.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from rackplane_agent import sshports
from rackplane_agent.runner import Agent
from rackplane_agent.runtimes.podman import (
    FROM_TENANT_CHAIN,
    WALL_CHAIN,
    PodmanRuntime,
    container_name,
    tenant_network,
    wall_leads,
)
from rackplane_bench import containers
from rackplane_bench.instances import parse_probes
from rackplane_wire import VolumeMount
from tests.fixtures.agent import (
    INVENTORY,
    SYSTEM_PY,
    FakeClient,
    assignment,
    assignments,
    config,
    open_dir,
    step_until,
    wait_until,
)

pytestmark = [
    pytest.mark.no_db,
    pytest.mark.skipif(
        containers.available() is not None, reason=f"no real containers: {containers.available()}"
    ),
]

VICTIM, ATTACKER, FRIEND, EXITS, STOPS, INSTANCE, KNOCKER = (
    f"00000000-0000-4000-8000-0000000000{i}" for i in ("c1", "c2", "c3", "c4", "c5", "c6", "c7")
)
SECRET = "hf_victim_5e2c9a"
PORT = 8080

# Tenant A's long-lived run: shows the secret it was given, then answers on PORT.
VICTIM_SCRIPT = f"""
echo "victim up hf=$HF_TOKEN"
while true; do echo hello-from-a | nc -l -p {PORT}; done
"""

# Waits for /tmp/go (put there by the test with `podman exec`), then tries each probe and
# prints `PROBE name refused|LEAKED detail`: `refused` when the command failed (its error is the
# detail). Positional arguments: the credential's host path, the victim's host pid and IP, the
# secret (as an attacker who knew it would search for it).
ATTACKER_SCRIPT = r"""
CRED=$1 VPID=$2 VIP=$3 SECRET=$4
echo "attacker up"
until [ -e /tmp/go ]; do sleep 0.05; done
probe() {
  n=$1; shift
  if out=$("$@" 2>&1); then echo "PROBE $n LEAKED $out"; else echo "PROBE $n refused $out"; fi
}
probe credential cat "$CRED"
probe credential_relative cat ../../credential
probe state_dir ls "${CRED%/*}"
probe state_dir_mounted grep -F "${CRED%/*}" /proc/self/mountinfo
probe victim_environ cat "/proc/$VPID/environ"
probe victim_signal kill -0 "$VPID"
probe other_tenant nc -w 3 "$VIP" 8080
probe chown chown 1:1 /tmp
probe mknod mknod /tmp/disk b 8 0
probe net_admin ip link add rp0 type dummy
probe mount mount -t tmpfs none /home
found=""
for f in /proc/[0-9]*/environ; do
  if grep -q "$SECRET" "$f" 2>/dev/null; then found="$found $f"; fi
done
if [ -z "$found" ]; then echo "PROBE environ_scan refused none"; else
  echo "PROBE environ_scan LEAKED $found"; fi
echo "PIDS $(ls -d /proc/[0-9]* | wc -l) init=$(tr '\0' ' ' < /proc/1/cmdline)"
echo "UIDMAP $(cat /proc/self/uid_map)"
grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status | sed 's/^/STATUS /'
echo "attacker done"
"""

# Tenant A's second container: the same wall lets it through.
FRIEND_SCRIPT = r"""
echo "friend up"
until [ -e /tmp/go ]; do sleep 0.05; done
echo "FRIEND $(nc -w 3 "$1" 8080 2>&1)"
"""


@dataclass(frozen=True)
class Podman:
    dir: Path  # its configuration, storage and networks' configs (rackplane_bench/containers.py)
    image: str
    environ: dict[str, str]  # the agent's environment: PATH and what points podman at `dir`
    tenants: dict[str, str]  # "a", "b" -> a tenant id of this test run only


@pytest.fixture(scope="module")
def podman_here():
    d = Path(tempfile.mkdtemp(prefix="rp-cwall-", dir="/tmp"))
    image = containers.build_image(d, "rpwall")
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **containers.env(d)}
    # The wall's rules are tagged by network (named after the tenant), and go at the end.
    tenants = {t: f"{t}-{uuid.uuid4().hex[:12]}" for t in ("a", "b")}
    yield Podman(d, image, environ, tenants)
    containers.cleanup(d)
    networks = PodmanRuntime(environ).networks()
    for tenant in tenants.values():
        networks.remove(tenant)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pod(podman_here):
    """The module's podman; every container goes when the test ends (after `state_dir`'s
    teardown has killed what its runs left: podman itself, not its containers)."""
    yield podman_here
    containers.cleanup(podman_here.dir)


@pytest.fixture
def work_dir():
    path = open_dir("rp-cwall-work-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _agent(state_dir: Path, client: FakeClient, work_dir: Path, environ: dict, uids: tuple, **kw):
    """An agent offering podman, its podman pointed at the test's configuration through the
    environment it is given (as an operator's unit file would)."""
    cfg = config(state_dir, runtimes=["process", "podman"], work_dir=work_dir, run_uids=uids, **kw)
    a = Agent(cfg, client, inventory=INVENTORY, environ=environ)
    a.prepare()
    return a


def _output(a: Agent, client: FakeClient, workload_id: str) -> str:
    a.ship_logs()
    return client.output(workload_id)


def _lines(output: str, prefix: str) -> list[str]:
    return [line[len(prefix) + 1 :] for line in output.splitlines() if line.startswith(prefix)]


def _pid_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _without_netavarks_isolation() -> None:
    """What netavark 1.4 does itself when any isolated network's last container goes away
    (its FORWARD jump deleted; the next isolated container's start puts it back), so that what
    the probes meet is the agent's wall alone."""
    jump = ["FORWARD", "-j", "NETAVARK_ISOLATION_1"]
    while subprocess.run(["iptables", "-w", "-D", *jump], capture_output=True).returncode == 0:
        pass


def _forward() -> list[str]:
    ipt = subprocess.run(["iptables", "-w", "-S", "FORWARD"], capture_output=True, text=True)
    return [r for r in ipt.stdout.splitlines() if r.startswith("-A FORWARD")]


def _subordinate_ids(user: str = "containers") -> tuple[int, int]:
    """(first, count) of `user`'s range in /etc/subuid, which --userns=auto carves from."""
    for line in Path("/etc/subuid").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == user:
            first, count = rest.split(":")
            return int(first), int(count)
    raise AssertionError(f"no {user} range in /etc/subuid (scripts/ensure-podman.sh adds it)")


def test_a_tenants_container_cannot_reach_the_agent_another_tenant_or_the_host(
    pod, state_dir, work_dir
):
    d, image, environ, tenants = pod.dir, pod.image, pod.environ, pod.tenants
    client = FakeClient()
    client.secret_env[VICTIM] = {"HF_TOKEN": SECRET, "RACKPLANE_TOKEN": "rpw_victim"}
    walls_before = _forward().count(f"-A FORWARD -j {WALL_CHAIN}")
    a = _agent(state_dir, client, work_dir, environ, (2_100_300, 2_100_399))
    a.state.write_credential("rpn_" + "N" * 40, {"node_name": "node-1"})
    credential = state_dir / "credential"
    assert credential.is_file()

    def container(wid: str, tenant: str, script: str, *args: str, **kw):
        return assignment(
            wid, ["sh", "-c", script, "sh", *args], runtime="podman", image=image,
            tenant=tenants[tenant], grace_s=2.0, **kw,
        )  # fmt: skip

    victim = container(VICTIM, "a", VICTIM_SCRIPT, fetch_env=True)
    a.set_assignments(assignments(victim))
    step_until(a, lambda: "victim up" in _output(a, client, VICTIM), timeout=20)
    # The workload's env arrived inside the container ...
    assert f"victim up hf={SECRET}" in _output(a, client, VICTIM)
    name = container_name(victim)
    victim_ip = containers.ip_of(d, name)
    victim_pid = containers.podman(d, "inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
    assert SECRET.encode() in Path(f"/proc/{victim_pid}/environ").read_bytes()
    # ... and no host process has it: podman, conmon and the shim run in the agent's fixed env;
    # only the container's own processes (in a pid namespace of their own) carry it.
    rec = a.runs[f"{VICTIM}.0.0"]
    podman_proc = psutil.Process(rec.pid).children()[0]
    assert Path(podman_proc.exe()).name == "podman"
    assert "HF_TOKEN" not in podman_proc.environ() and SECRET not in " ".join(podman_proc.cmdline())
    assert podman_proc.environ().get("CONTAINERS_CONF") == environ["CONTAINERS_CONF"]
    host_ns = _pid_ns("self")
    holders = []
    for p in psutil.process_iter():
        try:
            if SECRET.encode() in Path(f"/proc/{p.pid}/environ").read_bytes():
                holders.append(p.pid)
        except OSError:
            pass
    assert holders and str(victim_pid) in map(str, holders)
    assert [pid for pid in holders if _pid_ns(pid) == host_ns] == []

    attacker = container(ATTACKER, "b", ATTACKER_SCRIPT, str(credential), victim_pid, victim_ip,
                         SECRET)  # fmt: skip
    friend = container(FRIEND, "a", FRIEND_SCRIPT, victim_ip)
    a.set_assignments(assignments(victim, attacker, friend, index=2))
    step_until(
        a,
        lambda: (
            "attacker up" in _output(a, client, ATTACKER)
            and "friend up" in _output(a, client, FRIEND)
        ),
        timeout=20,
    )
    # The tenants' networks: one each, netavark-isolated, walled off by the agent's own rules.
    nets = {t: tenant_network(tenants[t]) for t in ("a", "b")}
    for t, net in nets.items():
        info = json.loads(containers.podman(d, "network", "inspect", net).stdout)[0]
        assert info["options"].get("isolate") == "true" and info["dns_enabled"] is False
        assert info["labels"]["rackplane.tenant"] == tenants[t]
    ipt = subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True).stdout
    forward = [r for r in ipt.splitlines() if r.startswith("-A FORWARD")]
    # The wall leads FORWARD, put there once by these starts, and again at most once per
    # tenant network made here: netavark may put its own jump above the wall when it makes
    # one, and the wall goes in again at the top (the copy lower down is harmless:
    # `wall_leads`; how often that happens is a race, which failed a stricter bound).
    walls = forward.count(f"-A FORWARD -j {WALL_CHAIN}")
    assert wall_leads(forward) and 1 <= walls <= walls_before + 1 + len(nets), (
        forward,
        walls_before,
    )
    assert all(f"--comment {n}" in ipt for n in nets.values()) and FROM_TENANT_CHAIN in ipt
    _without_netavarks_isolation()
    for ready in (attacker, friend):
        containers.podman(d, "exec", container_name(ready), "touch", "/tmp/go")
    step_until(
        a,
        lambda: all((r := client.last(w)) and r.state == "exited" for w in (ATTACKER, FRIEND)),
        timeout=20,
    )
    out = _output(a, client, ATTACKER)
    assert "attacker done" in out, out
    probes = parse_probes(out)
    assert set(probes) == {
        "credential", "credential_relative", "state_dir", "state_dir_mounted", "victim_environ",
        "victim_signal", "other_tenant", "chown", "mknod", "net_admin", "mount", "environ_scan",
    }, out  # fmt: skip
    assert {k: v for k, v in probes.items() if v[0] != "refused"} == {}, out
    # Each refusal is the one the wall gives: the host's paths are not there at all, the host's
    # processes do not exist in its pid namespace, the other tenant's packets are dropped (a
    # timeout, not a refused connection), and root in the container has no capability.
    assert "No such file or directory" in probes["credential"][1]
    assert "No such file or directory" in probes["credential_relative"][1]
    assert "No such file or directory" in probes["state_dir"][1]
    assert probes["state_dir_mounted"][1] == ""  # grep found nothing
    assert "No such file or directory" in probes["victim_environ"][1]
    assert "No such process" in probes["victim_signal"][1]
    assert "timed out" in probes["other_tenant"][1]
    for p in ("chown", "mknod", "net_admin"):
        assert "Operation not permitted" in probes[p][1], (p, probes[p])
    assert "permission denied" in probes["mount"][1]  # busybox's words for EPERM
    # Its own processes only: podman's init, its shell and what the shell runs.
    pids, init = _lines(out, "PIDS")[0].split(" ", 1)
    assert int(pids) <= 6 and "podman-init" in init, out
    # Root inside is an unprivileged uid on the host: 65536 ids from the subordinate range.
    inside, host, size = (int(x) for x in _lines(out, "UIDMAP")[0].split())
    first, count = _subordinate_ids()
    assert (inside, size) == (0, 65536) and first <= host and host + size <= first + count, out
    status = dict(line.split(":\t") for line in _lines(out, "STATUS"))
    assert status == {
        "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000", "NoNewPrivs": "1",
    }, out  # fmt: skip
    # The host sees the victim's root as an unprivileged uid of that range too, not the
    # attacker's: each container has ids of its own.
    victim_uid = psutil.Process(int(victim_pid)).uids().real
    assert first <= victim_uid < first + count and not host <= victim_uid < host + size
    # Tenant A's other container got through the same wall.
    assert _lines(_output(a, client, FRIEND), "FRIEND") == ["hello-from-a"]
    # And the victim is untouched.
    assert client.last(VICTIM).state == "running"
    a.close()


def test_a_containers_exit_code_and_stop_go_through_the_agent(pod, state_dir, work_dir):
    """A container's exit code is the run's; a stop's SIGTERM reaches the workload (podman's
    init forwards it) and ends the run well inside its grace, and the container is gone."""
    d, image, environ, tenants = pod.dir, pod.image, pod.environ, pod.tenants
    client = FakeClient()
    a = _agent(state_dir, client, work_dir, environ, (2_100_400, 2_100_499))
    exits = assignment(
        EXITS, ["sh", "-c", "echo bye $(ls /sys/class/net); exit 7"], runtime="podman",
        image=image,
    )  # fmt: skip
    stops = assignment(
        STOPS, ["sh", "-c", "echo up; exec sleep 60"], runtime="podman", image=image,
        tenant=tenants["a"], grace_s=30.0,
    )  # fmt: skip
    a.set_assignments(assignments(exits, stops))
    step_until(
        a,
        lambda: (
            (r := client.last(EXITS)) and r.state == "exited"
            and "up" in _output(a, client, STOPS)
        ),
        timeout=20,
    )  # fmt: skip
    r = client.last(EXITS)
    assert (r.exit_code, r.signal, r.stopped) == (7, None, False)
    assert "bye lo\n" in _output(a, client, EXITS)  # no tenant: --network none, only lo
    asked = time.monotonic()
    a.set_assignments(assignments(stops.model_copy(update={"desired": "stop"}), index=2))
    step_until(a, lambda: (r := client.last(STOPS)) and r.state == "exited", timeout=20)
    took = time.monotonic() - asked
    r = client.last(STOPS)
    assert r.stopped and took < 10, (r, took)
    # sleep died of the SIGTERM catatonit forwarded; podman reports it as 128 + 15.
    assert (r.exit_code, r.signal) == (143, None), r
    wait_until(
        lambda: (
            containers.podman(
                d, "ps", "-a", "-q", "--filter", f"name={container_name(stops)}"
            ).stdout.strip()
            == ""
        ),
        timeout=10,
    )
    a.close()


# --- an instance one logs into -----------------------------------------------------------------

SSH_PORTS = (22300, 22349)  # this test's agent's --ssh-ports

# Tenant B knocks on tenant A's instance through the host's address (DNAT'd to A's bridge, so
# routed: the wall's), and, to tell a drop from nobody listening, on a port nobody serves.
KNOCKER_SCRIPT = r"""
echo "knocker up"
until [ -e /tmp/go ]; do sleep 0.05; done
echo "SSHPORT $(nc -w 3 "$1" "$2" </dev/null 2>&1 | head -c 80)"
echo "CLOSED $(nc -w 3 "$1" "$3" </dev/null 2>&1 | head -c 80)"
"""


def _keypair(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path.with_suffix(".pub").read_text().strip()


def _ssh(key: Path, port: int, command: str) -> subprocess.CompletedProcess[str]:
    argv = containers.ssh_args(key, "127.0.0.1", user="root", port=port)
    return subprocess.run(
        [*argv, command], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )


def _host_address() -> str:
    """The host's own address on its default route (or any non-loopback one)."""
    got = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True, text=True)
    words = got.stdout.split()
    if "src" in words:
        return words[words.index("src") + 1]
    raise AssertionError(f"no source address for the default route: {got.stdout}{got.stderr}")


@pytest.mark.skipif(
    not (shutil.which("ssh") and shutil.which("ssh-keygen") and shutil.which("ssh-keyscan")),
    reason="no OpenSSH client",
)
@pytest.mark.skipif(
    not (Path("/usr/sbin/dropbear").exists() and shutil.which("dropbearkey")),
    reason="no dropbear on this host (scripts/ensure-podman.sh installs dropbear-bin)",
)
def test_a_container_with_ssh_keys_is_an_instance_one_logs_into_as_root(pod, state_dir, work_dir):
    """The agent picks a port of its range, brings dropbear into an image with no SSH server
    and no glibc (busybox-static), reports the port and then that the server answers; the key
    logs in as root (the container's: an unprivileged id of the host, SETUID and SETGID only),
    another key does not, the host key's fingerprint is in the run's output, and another
    tenant's container cannot reach the port (the wall drops what DNAT routes to A's bridge)."""
    image, environ, tenants = pod.image, pod.environ, pod.tenants
    keys = open_dir("rp-cwall-keys-")
    try:
        pub = _keypair(keys / "tenant")
        _keypair(keys / "stranger")
        client = FakeClient()
        a = _agent(
            state_dir, client, work_dir, environ, (2_100_500, 2_100_599), ssh_ports=SSH_PORTS
        )
        assert "ssh" in a.inventory.capabilities
        inst = assignment(
            INSTANCE, ["sh", "-c", "echo instance up as $(id -u) umask $(umask); exec sleep 60"],
            runtime="podman", image=image, tenant=tenants["a"], grace_s=2.0, ssh_keys=[pub],
        )  # fmt: skip
        began = time.monotonic()
        a.set_assignments(assignments(inst))
        step_until(a, lambda: (r := client.last(INSTANCE)) and r.state == "running", timeout=20)
        first = client.last(INSTANCE)
        port = first.ssh_port
        assert port is not None and SSH_PORTS[0] <= port <= SSH_PORTS[1], first
        assert a.runs[f"{INSTANCE}.0.0"].ssh_port == port
        step_until(a, lambda: client.last(INSTANCE).ssh_ready, timeout=30, interval=0.1)
        ready_s = time.monotonic() - began
        assert client.last(INSTANCE).ssh_port == port

        # The tenant's key logs in as root, a root with no capability but SETUID and SETGID,
        # mapped to an unprivileged id of the host.
        t0 = time.monotonic()
        got = _ssh(
            keys / "tenant", port, "id; grep CapEff /proc/self/status; cat /proc/self/uid_map"
        )
        login_s = time.monotonic() - t0
        assert got.returncode == 0, got
        lines = got.stdout.splitlines()
        assert lines[0].startswith("uid=0(root) gid=0(root)"), got.stdout
        assert lines[1].split() == ["CapEff:", "00000000000000c0"], got.stdout
        inside, host, size = (int(x) for x in lines[2].split())
        first_id, count = _subordinate_ids()
        assert (inside, size) == (0, 65536) and first_id <= host < first_id + count, got.stdout
        # Another key is refused.
        refused = _ssh(keys / "stranger", port, "id")
        assert refused.returncode == 255 and "Permission denied (publickey)" in refused.stderr, (
            refused
        )
        # The host key the client meets is the one whose fingerprint the run printed.
        out = _output(a, client, INSTANCE)
        assert "instance up as 0 umask 0022" in out, out  # the init's umask 077 stayed its own
        printed = _lines(out, "RACKPLANE-SSH-HOSTKEY")
        scan = subprocess.run(
            ["ssh-keyscan", "-t", "ed25519", "-p", str(port), "127.0.0.1"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        seen = subprocess.run(
            ["ssh-keygen", "-l", "-f", "-"], input=scan.stdout, capture_output=True, text=True
        )
        assert len(printed) == 1 and printed[0].startswith("SHA256:"), out
        assert seen.stdout.split()[1] == printed[0], (seen.stdout, printed)

        # Tenant B cannot reach it through the host's address (netavark's own isolation taken
        # away first: the agent's wall alone): a drop (timed out), where a port nobody serves
        # answers at once.
        host_ip = _host_address()
        closed = next(p for p in range(SSH_PORTS[1] + 1, 65_000) if sshports.bindable(p))
        knock = assignment(
            KNOCKER, ["sh", "-c", KNOCKER_SCRIPT, "sh", host_ip, str(port), str(closed)],
            runtime="podman", image=image, tenant=tenants["b"], grace_s=2.0,
        )  # fmt: skip
        a.set_assignments(assignments(inst, knock, index=2))
        step_until(a, lambda: "knocker up" in _output(a, client, KNOCKER), timeout=20)
        _without_netavarks_isolation()  # netavark put it back as the knocker started
        containers.podman(pod.dir, "exec", container_name(knock), "touch", "/tmp/go")
        step_until(a, lambda: (r := client.last(KNOCKER)) and r.state == "exited", timeout=30)
        knocked = _output(a, client, KNOCKER)
        assert knock.ssh_port is None and client.last(KNOCKER).ssh_port is None
        sshport, closed_port = _lines(knocked, "SSHPORT"), _lines(knocked, "CLOSED")
        assert sshport and "timed out" in sshport[0] and "SSH-" not in sshport[0], knocked
        assert closed_port and "refused" in closed_port[0], knocked
        assert client.last(INSTANCE).state == "running"
        print(f"\ncontainer ssh: ready {ready_s:.1f}s after the assignment, login {login_s:.2f}s")
        a.close()
    finally:
        shutil.rmtree(keys, ignore_errors=True)


def test_a_containers_volume_keeps_its_files_for_the_tenants_next_run(pod, state_dir, work_dir):
    """Issue 45 item 13: a container writes to its tenant's volume (bind-mounted, handed to
    its own root for the run, no set-uid); the tenant's next container, and then a process
    run of the tenant (its own uid, the tenant's gid), read what it wrote; a read-only mount
    refuses a write."""
    image, environ, tenants = pod.image, pod.environ, pod.tenants
    client = FakeClient()
    volumes = open_dir("rp-cvolumes-")
    a = _agent(
        state_dir, client, work_dir, environ, (2_100_500, 2_100_599),
        volumes_dir=volumes,
    )  # fmt: skip
    vol = VolumeMount(id="0000cccc-0000-4000-8000-000000000001", name="ckpt", storage="node",
                      mount_path="/ckpt")  # fmt: skip
    tenant = dict(tenant=tenants["a"], run_gid=2_200_011)
    write = assignment(
        EXITS, ["sh", "-c", "echo step-40 > /ckpt/latest && touch /ckpt/s && chmod u+s /ckpt/s "
                "&& echo wrote"],
        runtime="podman", image=image, volumes=[vol], **tenant,
    )  # fmt: skip
    a.set_assignments(assignments(write))
    step_until(a, lambda: (r := client.last(EXITS)) and r.state == "exited", timeout=30)
    assert client.last(EXITS).exit_code == 0, _output(a, client, EXITS)
    ro = vol.model_copy(update={"read_only": True})
    read = assignment(
        STOPS, ["sh", "-c", "cat /ckpt/latest; echo x > /ckpt/no || echo refused"],
        runtime="podman", image=image, volumes=[ro], **tenant,
    )  # fmt: skip
    a.set_assignments(assignments(read, index=2))
    step_until(a, lambda: (r := client.last(STOPS)) and r.state == "exited", timeout=30)
    out = _output(a, client, STOPS)
    assert "step-40" in out and "refused" in out, out
    host = volumes / tenants["a"] / vol.id
    assert not (host / "no").exists()
    # A process run of the tenant takes the files back (root:<tenant gid>, no set-uid left).
    proc = vol.model_copy(update={"mount_path": "ckpt"})
    code = "print('proc', open('ckpt/latest').read().strip(), flush=True)"
    again = assignment(INSTANCE, [SYSTEM_PY, "-c", code], volumes=[proc], **tenant)
    a.set_assignments(assignments(again, index=3))
    step_until(a, lambda: (r := client.last(INSTANCE)) and r.state == "exited", timeout=30)
    assert "proc step-40" in _output(a, client, INSTANCE), _output(a, client, INSTANCE)
    s = (host / "s").stat()
    assert (s.st_uid, s.st_gid) == (0, 2_200_011) and not s.st_mode & 0o4000
    a.close()
    shutil.rmtree(volumes, ignore_errors=True)
