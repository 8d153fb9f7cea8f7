"""Instances one logs into, from the API to an SSH login (issue 44 §3 and §4).

`InstanceHost` is a whole deployment on this machine: a scratch PostgreSQL database and Redis
prefix with an API and a worker (`ScratchDeployment`), one real `rackplane agent` (as root, as
on a GPU host) offering the `podman` and `vm` runtimes, a container image and a VM guest built
here (never pulled: `containers.build_image`, `vmguest.build`), a CDI spec for the node's GPUs
(as `nvidia-ctk cdi generate` writes on a real host; here its devices carry only an
environment variable, there being no /dev/nvidia*), and two tenants, each with an SSH key
registered through `/v1/ssh-keys`.

`rackplane bench instances` launches container and VM instances through `POST /v1/workloads`
one after another and times each from the POST to the first SSH login with the tenant's key
that runs a command (what a customer waits for), then tries the escapes of §4 from inside
them over SSH and counts those that worked. tests/workloads/test_instances.py runs the same host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from rackplane_agent.runtimes.vm import probe_host
from rackplane_bench import containers, vmguest
from rackplane_bench.deploy import ROOT, ScratchDeployment, pct

NODE = "inst-0"
GPUS = 8
MODEL = "H100-80GB"
SSH_PORTS = (23000, 23199)
CDI_DIR = Path("/var/run/cdi")
CDI_ENV = "RACKPLANE_STANDIN_CDI_GPU"  # what the stand-in CDI spec gives a GPU's container
ISOLATION = ["dedicated-gpu", "shared-timeslice", "shared-fractional", "shared-mig", "vm"]
SECRET = "hf_" + "instance_secret_7d1f"  # tenant B's env: A must not find it anywhere

FLEET = f"""
regions:
  - name: r1
    racks:
      - name: inst-rack
        kind: hgx
        gpu_model: {MODEL}
        nodes: [{{name: {NODE}, gpus: {GPUS}}}]
"""

_SEED = """
import json, sys
import app.models
from sqlalchemy import select
from app.core.db import session_scope
from app.fleet import document
from app.fleet.service import apply_document
from app.tenants.service import create_tenant
from app.keys.service import create_key
from app.agents.service import create_join_token
from app.models.fleet import Node
policy = json.loads(sys.argv[1])
with session_scope() as s:
    apply_document(s, document.load(sys.stdin.read()))
    out = {'operator': create_key(s, tenant_id=None, name='op', scopes=['platform']).key}
    for slug in ('a', 'b'):
        t = create_tenant(s, name='Tenant ' + slug, slug='inst-' + slug,
                          contact_email=slug + '@example.com', status='active',
                          isolation_policy=policy)
        out[slug] = [str(t.id), create_key(s, tenant_id=t.id, name='k',
                                           scopes=['read', 'write']).key]
    s.flush()
    node = s.scalars(select(Node)).one()
    out['node'] = str(node.id)
    out['join'] = create_join_token(s, node, 3600).token
    print(json.dumps(out))
"""


class Unavailable(Exception):
    """This machine cannot run the instances (the reason says what is missing)."""


def unavailable() -> str | None:
    """Why `InstanceHost` cannot run here, or None."""
    why = containers.available()
    if why:
        return why
    for tool in ("ssh", "ssh-keygen", "dropbear", "dropbearkey"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"{tool} is missing (scripts/ensure-podman.sh installs it)"
    try:
        vmguest.build()
    except vmguest.Unavailable as exc:
        return f"the VM guest cannot be built: {exc}"
    return None


@dataclass
class Tenant:
    slug: str
    id: str
    key: str  # its API key
    ssh_key: Path  # its private SSH key (the .pub beside it is registered as `laptop`)


@dataclass
class Launch:
    """One instance: when it was asked for and what it became."""

    tenant: Tenant
    runtime: str
    id: str
    posted: float  # time.monotonic() of the POST
    ssh_s: float | None = None  # POST -> the first login that ran a command
    ready_s: float | None = None  # POST -> the API's `connect.ready`
    connect: dict[str, Any] = field(default_factory=dict)


class InstanceHost:
    def __init__(self, *, ssh_ports: tuple[int, int] = SSH_PORTS, log: Callable = print):
        why = unavailable()
        if why:
            raise Unavailable(why)
        self.log = log
        self.dir = Path(tempfile.mkdtemp(prefix="rp-inst-", dir="/tmp"))
        self.dir.chmod(0o711)  # runs of their own uids traverse it to their work directories
        self.podman_dir = self.dir / "podman"
        self.image = containers.build_image(self.podman_dir, "rpinst")
        self.guest = vmguest.build()
        self.gpus = [f"GPU-{NODE}-{i}-{secrets.token_hex(3)}" for i in range(GPUS)]
        self.cdi = CDI_DIR / f"rackplane-standin-{secrets.token_hex(4)}.yaml"
        self._write_cdi()
        self.dep = ScratchDeployment(workers=1, env={"RACKPLANE_AGENT_START_TIMEOUT": "60"})
        self.agent: subprocess.Popen | None = None
        self.tenants: dict[str, Tenant] = {}
        try:
            self._start(ssh_ports)
        except BaseException:
            self.close()
            raise

    # --- setting up -------------------------------------------------------------------------

    def _write_cdi(self) -> None:
        CDI_DIR.mkdir(parents=True, exist_ok=True)
        spec = {
            "cdiVersion": "0.5.0",
            "kind": "nvidia.com/gpu",
            "devices": [
                {"name": u, "containerEdits": {"env": [f"{CDI_ENV}={u}"]}} for u in self.gpus
            ],
            "containerEdits": {},
        }
        self.cdi.write_text(yaml.safe_dump(spec))

    def _start(self, ssh_ports: tuple[int, int]) -> None:
        seeded = subprocess.run(
            [sys.executable, "-c", _SEED, json.dumps(ISOLATION)],
            cwd=ROOT,
            env=self.dep.env,
            input=FLEET,
            capture_output=True,
            text=True,
            check=True,
        )
        data = json.loads(seeded.stdout.strip().splitlines()[-1])
        self.operator, self.node_id = data["operator"], data["node"]
        self.url = self.dep.start(api_processes=1)
        self.http = httpx.Client(base_url=self.url, timeout=15)
        keys = self.dir / "keys"
        keys.mkdir()
        for slug in ("a", "b"):
            tid, key = data[slug]
            path = keys / slug
            _keygen(path)
            self.tenants[slug] = Tenant(slug, tid, key, path)
            made = self.http.post(
                "/v1/ssh-keys",
                json={"name": "laptop", "public_key": path.with_suffix(".pub").read_text()},
                headers=_auth(key),
            )
            made.raise_for_status()
        self.stranger = keys / "stranger"  # a key no tenant registered
        _keygen(self.stranger)

        inventory = self.dir / "inventory.yaml"
        gpus = [
            {"index": i, "uuid": u, "model": MODEL, "memory_mib": 81559}
            for i, u in enumerate(self.gpus)
        ]
        inventory.write_text(
            yaml.safe_dump(
                {
                    "hostname": NODE,
                    "gpus": gpus,
                    "driver_version": "550.54.15",
                    "cuda_version": "12.4",
                }
            )
        )
        self.state_dir = self.dir / "state"
        argv = [sys.executable, "-m", "rackplane_agent", "--api", self.url]
        argv += ["--token", data["join"], "--state-dir", str(self.state_dir)]
        argv += ["--work-dir", str(self.dir / "work"), "--inventory", str(inventory)]
        argv += ["--address", "127.0.0.1", "--runtime", "podman", "--runtime", "vm"]
        argv += ["--poll-wait", "20"]
        argv += ["--ssh-ports", f"{ssh_ports[0]}-{ssh_ports[1]}"]
        env = {
            **os.environ,
            **containers.env(self.podman_dir),
            "RACKPLANE_VM_IMAGE_DIRS": str(self.guest.image.parent),
            "RACKPLANE_VM_PASSTHROUGH": "none",  # no GPU to hand to the guest here
        }
        self.agent_log = self.dir / "agent.log"
        self.agent = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=open(self.agent_log, "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _until(self._node_ready, 60, "the node's agent joined and the node is ready")
        except RuntimeError as exc:
            node = self.http.get(f"/v1/admin/nodes/{self.node_id}", headers=_auth(self.operator))
            tail = self.agent_log.read_text()[-2000:]
            raise RuntimeError(f"{exc}; the node: {node.text[:500]}; the agent: {tail}") from None

    def _node_ready(self) -> bool:
        r = self.http.get(f"/v1/admin/nodes/{self.node_id}", headers=_auth(self.operator))
        if r.status_code != 200 or r.json()["state"] != "ready" or not r.json()["production_at"]:
            return False  # in service once its burn-in passed
        return "inventory_verdict" in self.agent_log.read_text()  # its inventory was taken

    # --- instances --------------------------------------------------------------------------

    def launch(self, tenant: Tenant, runtime: str, **extra: Any) -> Launch:
        """POST an instance of `runtime` (`podman` or `vm`) with the tenant's key."""
        body: dict[str, Any] = {"gpus": 1, "ssh_keys": ["laptop"], **extra}
        if runtime == "vm":
            body |= {"kind": "vm", "image": self.guest.image.name}
            body |= {"memory_mib": 256, "cpu_milli": 1000}
        else:
            body |= {"kind": "instance", "runtime": "podman", "image": self.image}
        posted = time.monotonic()
        r = self.http.post("/v1/workloads", json=body, headers=_auth(tenant.key))
        if r.status_code != 201:
            raise RuntimeError(f"POST /v1/workloads -> {r.status_code}: {r.text}")
        return Launch(tenant, runtime, r.json()["id"], posted)

    def get(self, launch: Launch) -> dict[str, Any]:
        r = self.http.get(f"/v1/workloads/{launch.id}", headers=_auth(launch.tenant.key))
        r.raise_for_status()
        return r.json()

    def wait_ssh(self, launch: Launch, timeout: float = 90) -> Launch:
        """As a customer would: poll the instance until its `connect` says ready, then log in
        and run a command (again, until it works); fills in the timings and `connect`. (An SSH
        attempt before ready may meet the port held, not yet forwarded, and hang until its
        timeout: the API's `ready` is what says when to try.)"""
        deadline = launch.posted + timeout
        while time.monotonic() < deadline:
            w = self.get(launch)
            if w["state"] not in ("queued", "placing", "provisioning", "running"):
                raise RuntimeError(f"instance {launch.id} is {w['state']}: {self.events(launch)}")
            if w["connect"] and w["connect"]["ready"]:
                launch.connect = w["connect"]
                if launch.ready_s is None:
                    launch.ready_s = time.monotonic() - launch.posted
                done = self.ssh(launch, launch.tenant.ssh_key, "true", timeout=10)
                if done.returncode == 0:
                    launch.ssh_s = time.monotonic() - launch.posted
                    return launch
            time.sleep(0.05)
        raise RuntimeError(f"no SSH login to {launch.id} in {timeout}s: {self.events(launch)}")

    def ssh(
        self, launch: Launch, key: Path, command: str, timeout: float = 20
    ) -> subprocess.CompletedProcess[str]:
        """`ssh -p PORT root@HOST command` as `connect` says, with `key`."""
        return run_ssh(key, launch.connect["host"], launch.connect["port"], command, timeout)

    def events(self, launch: Launch) -> list[str]:
        r = self.http.get(f"/v1/workloads/{launch.id}/events", headers=_auth(launch.tenant.key))
        return [
            f"{e['kind']} {e['from_state']}->{e['to_state']} {e['reason']} {e['details']}"
            for e in r.json().get("items", [])
        ]

    def logs(self, launch: Launch) -> str:
        r = self.http.get(
            f"/v1/workloads/{launch.id}/logs",
            params={"limit": 1000},
            headers=_auth(launch.tenant.key),
        )
        r.raise_for_status()
        return "".join(c["data"] for c in r.json()["items"])

    def terminate(self, launch: Launch, timeout: float = 60) -> float:
        """DELETE it; seconds until the last process of its run is gone on the node (a VM
        powered down, a container removed)."""
        began = time.monotonic()
        r = self.http.delete(f"/v1/workloads/{launch.id}", headers=_auth(launch.tenant.key))
        r.raise_for_status()
        _until(lambda: not processes_of(launch.id), timeout, f"{launch.id}'s processes gone")
        return time.monotonic() - began

    def close(self) -> None:
        from app.core.processes import stop_groups

        if getattr(self, "http", None) is not None:
            self.http.close()
        if self.agent is not None:
            stop_groups([self.agent])  # the agent's group; its runs' groups are their own
        # What the agent's runs left (it was stopped, not asked to end them).
        for run_json in (self.dir / "state").rglob("run.json"):
            try:
                pid = json.loads(run_json.read_text()).get("pid")
                if pid:
                    os.killpg(pid, 9)
            except (OSError, ValueError):
                pass
        if self.podman_dir.exists():
            containers.cleanup(self.podman_dir)
            from rackplane_agent.runtimes.podman import PodmanRuntime

            networks = PodmanRuntime(
                {"PATH": os.environ.get("PATH", ""), **containers.env(self.podman_dir)}
            ).networks()
            for t in self.tenants.values():
                networks.remove(t.id)
        self.cdi.unlink(missing_ok=True)
        self.dep.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- escapes ---------------------------------------------------------------------------------

# Run over SSH inside tenant A's instance: each probe prints `PROBE name refused|LEAKED detail`,
# `refused` when the command failed. $1 the agent's state directory, $2 B's container address,
# $3 B's SSH port on the node, $4 the node's address seen from inside, $5
# the secret B's env holds. (The control plane is no target: a run reaches the API by design,
# its checkpoints go there with its own token.)
PROBES = r"""
probe() {
  n=$1; shift
  if out=$("$@" 2>&1); then echo "PROBE $n LEAKED $(echo $out | head -c 200)"; else
    echo "PROBE $n refused $(echo $out | head -c 200)"; fi
}
probe credential cat "$1/credential"
probe credential_relative cat ../../credential
probe state_dir ls "$1/runs"
probe other_runs ls "$1/../work"
if [ -n "$2" ]; then probe other_tenant_ssh nc -w 3 "$2" 22 </dev/null; fi
probe other_tenant_port nc -w 3 "$4" "$3" </dev/null
found=""
for f in /proc/[0-9]*/environ; do
  if grep -q "$5" "$f" 2>/dev/null; then found="$found $f"; fi
done
if [ -z "$found" ]; then echo "PROBE environ_scan refused none"; else
  echo "PROBE environ_scan LEAKED $found"; fi
"""


def parse_probes(output: str) -> dict[str, tuple[str, str]]:
    """name -> (`refused` or `LEAKED`, detail), from `PROBE name verdict detail` lines (the
    escape scripts here and in tests/agent/test_container_wall.py print them)."""
    out = {}
    for line in output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == "PROBE":
            out[parts[1]] = (parts[2], parts[3] if len(parts) > 3 else "")
    return out


def escapes(host: InstanceHost) -> dict[str, Any]:
    """Tenant A's container and VM instances try what §4 lists against tenant B's instance
    and the node; every attempt that worked is an escape. B's key is also tried on A's
    instances, and a key nobody registered."""
    a, b = host.tenants["a"], host.tenants["b"]
    victim = host.wait_ssh(
        host.launch(b, "podman", env={"HF_TOKEN": SECRET}, command=["sleep", "infinity"])
    )
    got = host.ssh(victim, b.ssh_key, "ip -4 -o addr show eth0")
    b_ip = got.stdout.split()[3].split("/")[0] if got.returncode == 0 else ""
    results: dict[str, dict[str, tuple[str, str]]] = {}
    for runtime in ("podman", "vm"):
        mine = host.wait_ssh(host.launch(a, runtime))
        # Inside a container the node is its network's gateway; in a VM, QEMU's 10.0.2.2.
        if runtime == "vm":
            gateway = "10.0.2.2"
        else:
            route = host.ssh(mine, a.ssh_key, "ip route show default").stdout.split()
            gateway = route[2] if len(route) > 2 else "127.0.0.1"
        args = [str(host.state_dir), b_ip, str(victim.connect["port"]), gateway]
        command = "sh -s -- " + " ".join(_quote(x) for x in [*args, SECRET])
        done = subprocess.run(
            ssh_argv(a.ssh_key, mine.connect["host"], mine.connect["port"], command),
            input=PROBES,
            capture_output=True,
            text=True,
            timeout=120,
        )
        probes = parse_probes(done.stdout)
        if not probes:
            probes["probe_script"] = ("LEAKED", f"did not run: {done.stderr[-300:]}")
        for name, key in (("b_key", b.ssh_key), ("stranger_key", host.stranger)):
            login = host.ssh(mine, key, "id")
            probes[name] = (
                ("LEAKED", login.stdout.strip())
                if login.returncode == 0
                else ("refused", login.stderr.strip()[-120:])
            )
        results[runtime] = probes
        host.terminate(mine)
    # Through the API, with A's key: B's instance, its logs and its events are not A's to see.
    api = {}
    for name, path in (
        ("workload", ""),
        ("logs", "/logs"),
        ("events", "/events"),
    ):
        r = host.http.get(f"/v1/workloads/{victim.id}{path}", headers=_auth(a.key))
        api[name] = (
            ("refused", str(r.status_code))
            if r.status_code == 404
            else ("LEAKED", f"{r.status_code} {r.text[:120]}")
        )
    results["api"] = api
    host.terminate(victim)
    leaked = [
        f"{rt}:{name}"
        for rt, ps in results.items()
        for name, (verdict, _) in ps.items()
        if verdict != "refused"
    ]
    attempts = sum(len(ps) for ps in results.values())
    return {"attempts": attempts, "escapes": len(leaked), "leaked": leaked, "probes": results}


# --- the bench -------------------------------------------------------------------------------


def bench(launches: int = 10, log: Callable = print) -> dict[str, Any]:
    """`rackplane bench instances`: POST -> SSH login, `launches` of each runtime one after
    another (each terminated before the next), then the escapes."""
    host = InstanceHost(log=log)
    try:
        out: dict[str, Any] = {"launches": launches}
        tenants = list(host.tenants.values())
        for runtime, field_ in (("podman", "container"), ("vm", "vm")):
            ssh, ready, stops = [], [], []
            for i in range(launches):
                la = host.wait_ssh(host.launch(tenants[i % 2], runtime))
                assert la.ssh_s is not None and la.ready_s is not None
                ssh.append(la.ssh_s)
                ready.append(la.ready_s)
                stops.append(host.terminate(la))
                log(
                    f"{field_} {i + 1}/{launches}: ssh {la.ssh_s:.2f}s (ready {la.ready_s:.2f}s)"
                    f", terminated in {stops[-1]:.2f}s"
                )
            out[f"{field_}_ssh_ready_s"] = _p(ssh)
            out[f"{field_}_api_ready_s"] = _p(ready)
            out[f"{field_}_terminate_s"] = _p(stops)
        found = escapes(host)
        out["escapes"] = found["escapes"]
        out["escape_attempts"] = found["attempts"]
        out["leaked"] = found["leaked"]
        features = probe_host(shutil.which("qemu-system-x86_64"))
        out["vm_accel"] = "kvm" if features.kvm else "tcg"
        out["why_tcg"] = features.why_tcg
        return out
    finally:
        host.close()


def _p(xs: list[float]) -> dict[str, float]:
    return {"p50": round(pct(xs, 0.5), 2), "p95": round(pct(xs, 0.95), 2)}


# --- helpers ---------------------------------------------------------------------------------


def processes_of(workload_id: str) -> list[int]:
    """The node's processes that belong to a run of the workload: the shim, podman, conmon,
    QEMU (each names the run's directory or the container, `<workload id>.<attempt>...`)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(workload_id in arg for arg in p.info["cmdline"] or ()):
            out.append(p.pid)
    return out


def ssh_argv(key: Path, host: str, port: int, command: str) -> list[str]:
    argv = ["ssh", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes"]
    argv += ["-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no"]
    argv += ["-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5"]
    return [*argv, "-o", "LogLevel=ERROR", f"root@{host}", command]


def run_ssh(
    key: Path, host: str, port: int, command: str, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ssh_argv(key, host, port, command),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess([], 255, "", "timed out")


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"not in {timeout}s: {what}")
        time.sleep(0.1)
