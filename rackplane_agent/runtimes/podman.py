"""The `podman` runtime: `podman run` under the shim, the GPUs given as CDI devices.

The `container` tier's boundary (issue 44 §2; docs/design/containers-here.md has what each
flag was tried against). Every run gets:

- `--userns=auto:size=65536`: a user namespace of its own, carved by podman from the
  subordinate ids of the user `containers` (/etc/subuid, /etc/subgid), disjoint from every
  other container's: root inside is an unprivileged, unnamed uid on the host (2147483647 and
  up where scripts/ensure-podman.sh set the range). 65536 ids cover an image's usual owners
  (nobody is 65534) and any `USER` it names; podman's automatic sizing stops at 65536 anyway.
- `--security-opt no-new-privileges`: no setuid binary or file capability raises a privilege.
- `--cap-drop all`, with no allowlist. A training or serving job runs as one user writing its
  own files and needs none; what podman would otherwise keep (CHOWN, DAC_OVERRIDE, FOWNER,
  FSETID, KILL, NET_BIND_SERVICE, SETFCAP, SETGID, SETPCAP, SETUID, SYS_CHROOT) serves image
  builds and daemons that switch users (apt's sandbox, gosu, su, sshd as root). Even namespaced
  they widen the kernel surface a tenant reaches. An image whose entrypoint needs them fails
  visibly (`Operation not permitted` in its log), which is the honest answer on a shared node.
  An instance one logs into gets SETUID and SETGID back, and only those (below).
- `--init`: podman's catatonit is PID 1, forwards the agent's signals to the workload and reaps
  it. Without it the workload is PID 1, and the kernel drops every signal PID 1 has no handler
  for: a stop's SIGTERM would do nothing and each stop would last the whole grace.
- `--pids-limit 16384`: a fork bomb stays in its container (threads count: 8 ranks each with
  16 data-loader workers of ~60 threads fit).
- `--network rp-tenant-<16 hex of sha256(tenant)>`, the tenant's own bridge, made on first use
  (`TenantNetworks`), with a wall of the agent's own in iptables between tenants' bridges; a
  run with no tenant gets `--network none`.
- `--pull missing`: images come from their registries as on any cloud, once per node, whatever
  the node's containers.conf says. (Images are anonymous pulls today; when registry
  credentials reach the wire, a run that uses them must pull with `always`, as Kubernetes'
  AlwaysPullImages does, or a tenant could run another's private image from the node's cache.)
- No `--read-only`: the wire has no field to ask for it, so nothing here decides it.

`podman run` proxies the signals it gets to the container (`--sig-proxy`, on by default), so
SIGTERM and the checkpoint signal reach the workload like a host process's. A SIGKILL cannot be
proxied: when the agent kills the group it also asks podman to kill the container.

An instance one logs into (a run with `ssh_keys`; the runtime advertises the `ssh` capability
where the host has dropbear, dropbearkey and ldd) gets an SSH server the agent brings, so any
image with /bin/sh will do (`sshbundle.py`; docs/design/containers-here.md says why this
design). On top of the flags above:

- `--volume <state>/ssh-bundle/<digest>:/.rackplane/ssh:ro`: dropbear, its libraries and their
  loader, and the init script, which is the container's command before the workload's
  (`/.rackplane/ssh/init COMMAND...`): it writes the keys to root's authorized_keys, makes a
  host key and prints its fingerprint to the run's output (`RACKPLANE-SSH-HOSTKEY SHA256:...`),
  starts dropbear on port 22 and execs the command;
- `--user 0:0`: one logs in as `root` (the container's, an unprivileged id of the host), and
  the workload runs as that root too, whatever the image's `USER`;
- `--cap-add SETUID,SETGID`: dropbear switches to the user logging in. In the container's own
  user namespace, with no-new-privileges, they switch only among the container's own 65536
  mapped ids (seen: CapEff 0xc0, uid_map `0 2147483647 65536`);
- `--sysctl net.ipv4.ip_unprivileged_port_start=22` (the container's network namespace only):
  dropbear binds 22 without NET_BIND_SERVICE;
- `--publish PORT:22`, PORT the one the agent picked from its `--ssh-ports` (`ssh_port`), on
  the tenant's network: the wall between tenants' bridges drops another tenant's connections
  to it (DNAT'd traffic is routed like any other);
- `--env RACKPLANE_SSH_KEYS=...`: the keys, one a line (public, so argv may show them; the
  env-file pipe carries no line breaks).

A run with keys and no tenant is refused (`--network none` publishes nothing), as is one on a
host without the tools. The image's ENTRYPOINT, if it has one, runs first and gets the init
script as its first argument: entrypoints that end in `exec "$@"` (the usual kind) start it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.logfmt import kv
from rackplane_agent.runtimes.base import (
    RunPlace,
    ShimRuntime,
    StartError,
    WorkloadStartError,
    base_env,
    spawn_shim,
)
from rackplane_agent.runtimes.sshbundle import INIT as SSH_INIT
from rackplane_agent.runtimes.sshbundle import MOUNT as SSH_MOUNT
from rackplane_agent.runtimes.sshbundle import SshBundle
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE, RunRecord
from rackplane_wire import Assignment

log = logging.getLogger("rackplane_agent.podman")

# What podman needs from the agent's environment (never the workload's), besides the basics.
PODMAN_ENV = (
    "HOME",
    "XDG_RUNTIME_DIR",
    "XDG_CONFIG_HOME",
    "CONTAINERS_CONF",
    "CONTAINERS_STORAGE_CONF",
    "CONTAINER_HOST",
)
# The fd on which the shim hands podman the workload's env (`--env-file /dev/fd/N`).
ENV_FD = 20
USERNS_SIZE = 65536
# What the SSH keys may take in podman's argv (Linux holds one argument to 128 KiB).
MAX_SSH_KEYS_BYTES = 120_000
PIDS_LIMIT = 16384
NETWORK_PREFIX = "rp-tenant-"
# The agent's iptables chains (filter table): WALL_CHAIN, first in FORWARD, sends what comes in
# on a tenant's bridge to FROM_TENANT_CHAIN, which drops it when it leaves on another tenant's.
WALL_CHAIN = "RACKPLANE_TENANT_WALL"
FROM_TENANT_CHAIN = "RACKPLANE_FROM_TENANT"
# netavark's chain (nat table) that DNATs the node's published ports to containers.
HOSTPORT_CHAIN = "NETAVARK-HOSTPORT-DNAT"
# Where iptables is when the agent's PATH lacks the sbin directories.
_SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def container_name(assignment: Assignment) -> str:
    wid = _NAME_UNSAFE.sub("_", assignment.workload_id)
    return f"rp-{wid}-{assignment.attempt}-{assignment.replica}"


def tenant_network(tenant: str | None) -> str | None:
    """The podman network of a tenant's containers on this node (None: no tenant, no network).
    A digest, not the id itself: any id makes a valid name, and names of one length."""
    if tenant is None:
        return None
    return NETWORK_PREFIX + hashlib.sha256(tenant.encode()).hexdigest()[:16]


def podman_argv(
    assignment: Assignment, podman: str = "podman", ssh_bundle: Path | None = None
) -> list[str]:
    """`podman run` for an assignment, with the tier's boundary (the module's docstring says
    why each flag). The env is neither on the command line (any user may read a process's
    argv, and the env carries RACKPLANE_TOKEN) nor in podman's own environment (where PATH,
    LD_PRELOAD or CONTAINERS_CONF would steer podman itself): the shim hands it over on a pipe
    (`--env-file /dev/fd/N`). `--` ends podman's options, so no image name is read as one.
    With `ssh_keys`: an SSH server from `ssh_bundle` on `ssh_port` (the module's docstring)."""
    if not assignment.image:
        raise StartError("the podman runtime needs an image")
    if assignment.ssh_keys:
        if assignment.tenant is None:
            raise StartError("a container one logs into needs a tenant (its network)")
        if ssh_bundle is None:
            raise StartError("this node cannot bring an SSH server into a container")
        if assignment.ssh_port is None:
            raise StartError("the agent gave the run no SSH port")
        if ":" in str(ssh_bundle) or "," in str(ssh_bundle):
            raise StartError(f"the SSH bundle's path {ssh_bundle} holds a ':' or ','")
    argv = [
        podman,
        "run",
        "--rm",
        "--name",
        container_name(assignment),
        "--label",
        f"rackplane.workload={assignment.workload_id}",
        "--label",
        f"rackplane.attempt={assignment.attempt}",
        "--label",
        f"rackplane.replica={assignment.replica}",
    ]
    if assignment.tenant is not None:
        argv += ["--label", f"rackplane.tenant={assignment.tenant}"]
    for device in assignment.devices:
        argv += ["--device", f"nvidia.com/gpu={device}"]
    argv += ["--env-file", f"/dev/fd/{ENV_FD}"]
    if assignment.workdir:
        argv += ["--workdir", assignment.workdir]
    argv += [
        f"--userns=auto:size={USERNS_SIZE}",
        "--security-opt",
        "no-new-privileges",
        "--cap-drop",
        "all",
        "--init",
        "--pids-limit",
        str(PIDS_LIMIT),
        "--network",
        tenant_network(assignment.tenant) or "none",
        "--pull",
        "missing",
    ]
    command = list(assignment.command)
    if assignment.ssh_keys:
        keys = "\n".join(k.strip() for k in assignment.ssh_keys)
        if len(keys) > MAX_SSH_KEYS_BYTES:
            raise StartError(
                f"the run's SSH keys take {len(keys)} bytes, more than the {MAX_SSH_KEYS_BYTES} "
                "one argument of podman's may hold"
            )
        argv += [
            "--volume", f"{ssh_bundle}:{SSH_MOUNT}:ro",
            "--user", "0:0",
            "--cap-add", "SETUID,SETGID",
            "--sysctl", "net.ipv4.ip_unprivileged_port_start=22",
            "--publish", f"{assignment.ssh_port}:22/tcp",
            "--env", f"RACKPLANE_SSH_KEYS={keys}",
        ]  # fmt: skip
        command = [SSH_INIT, *command]
    if assignment.serve is not None and assignment.serve_port is not None:
        argv += ["--publish", f"{assignment.serve_port}:{assignment.serve.port}/tcp"]
    if assignment.cpu_milli > 0:
        argv += ["--cpus", f"{assignment.cpu_milli / 1000:g}"]
    if assignment.memory_mib > 0:
        argv += ["--memory", f"{assignment.memory_mib}m"]
    argv += ["--stop-timeout", str(math.ceil(assignment.grace_s))]
    argv += ["--", assignment.image, *command]
    return argv


def with_volumes(argv: list[str], place: RunPlace) -> list[str]:
    """`argv` with the run's volumes bind-mounted before the image (`--`): each handed to the
    container's own root for this run (`U`: its user namespace is its own), read-only where
    asked; `nosuid,nodev` whatever the image does."""
    if not place.volumes:
        return argv
    extra = []
    for v, host in place.volumes:
        if ":" in str(host) or "," in str(host):
            raise StartError(f"volume {v.name}: its directory {host} holds a ':' or ','")
        opts = ",".join(["ro" if v.read_only else "rw", "U", "nosuid", "nodev"])
        extra += ["--volume", f"{host}:{v.mount_path}:{opts}"]
    at = argv.index("--")
    return argv[:at] + extra + argv[at:]


def check_env(env: dict[str, str]) -> None:
    """An env-file line holds one `NAME=value`: a value with a line break cannot be passed (the
    workload's env and secrets are its own: its fault, not the node's)."""
    broken = sorted(k for k, v in env.items() if "\n" in v or "\r" in v)
    if broken:
        raise WorkloadStartError(
            f"env {', '.join(broken)} holds a line break, which the podman runtime cannot pass"
        )


class TenantNetworks:
    """Each tenant's bridge network on this node, and the wall between them.

    The network is made on a tenant's first run (`podman network create`, netavark's
    `isolate=true`, no DNS: aardvark-dns would be one resolver shared by every tenant, and it
    prints syslog noise into the run's log), and kept. Two agents or threads making it at once
    are fine: the loser's create fails with the name taken and it reads the winner's network.

    netavark's isolation alone is no wall: netavark 1.4 (Debian 12) deletes its
    `FORWARD -j NETAVARK_ISOLATION_1` jump when the last container of ANY isolated network
    goes away, and the live ones reach each other again (docs/design/containers-here.md). So
    the agent keeps its own rules, one set per tenant bridge, tagged with the network's name:

        FORWARD (first):        -j RACKPLANE_TENANT_WALL
        RACKPLANE_TENANT_WALL:  -i <bridge> -j RACKPLANE_FROM_TENANT
        RACKPLANE_FROM_TENANT:  -i <bridge> -o <bridge> -j RETURN   (inserted first)
                                -o <bridge> -j DROP                 (appended)

    Routed traffic from one tenant's bridge to another's is dropped; within a bridge, out to
    the world and between the host and a container it passes. Each rule is checked (-C) and
    added only when missing, on every run's start, so a firewall reload is repaired by the
    next start; without iptables a tenant's run does not start (the wall fails closed)."""

    def __init__(self, podman: str, environ: Mapping[str, str]):
        self._podman = podman
        self._env = base_env(environ, PODMAN_ENV)
        path = environ.get("PATH")
        self._iptables = shutil.which(
            "iptables", path=f"{path}:{_SBIN_PATH}" if path else _SBIN_PATH
        )

    def ensure(self, tenant: str) -> str:
        """The tenant's network, made if missing, with the wall around its bridge. Raises
        StartError."""
        name = tenant_network(tenant)
        assert name is not None
        with _NETWORK_LOCK:
            info = self._inspect(name)
            if info is None:
                made = self._run_podman(
                    "network", "create", "--opt", "isolate=true", "--disable-dns",
                    "--label", f"rackplane.tenant={tenant}", name,
                )  # fmt: skip
                info = self._inspect(name)  # ours, or the one another agent made meanwhile
                if info is None:
                    raise StartError(f"cannot create network {name}: {made.stderr.strip()}")
            bridge = info.get("network_interface")
            if not isinstance(bridge, str) or not bridge:
                raise StartError(f"network {name} has no bridge (driver {info.get('driver')})")
            self._wall(name, bridge)
        return name

    def remove(self, tenant: str) -> None:
        """The tenant's network and its rules go (its containers must be gone)."""
        name = tenant_network(tenant)
        assert name is not None
        with _NETWORK_LOCK:
            if self._iptables is not None:
                for chain in (WALL_CHAIN, FROM_TENANT_CHAIN):
                    for rule in self._rules(chain):
                        if f"--comment {name}" in rule or f'--comment "{name}"' in rule:
                            self._ipt("-D", chain, *shlex.split(rule)[2:])
            self._run_podman("network", "rm", "--force", name)

    def forwarded_ports(self) -> set[int]:
        """The TCP ports netavark's port-forwarding chain (NETAVARK-HOSTPORT-DNAT) names."""
        if self._iptables is None:
            return set()
        try:
            got = self._ipt("-t", "nat", "-S", HOSTPORT_CHAIN)
        except StartError:
            return set()
        ports: set[int] = set()
        for rule in got.stdout.splitlines():
            words = rule.split()
            if "--dport" in words and words.index("--dport") + 1 < len(words):
                low, _, high = words[words.index("--dport") + 1].partition(":")
                if low.isdigit() and (not high or high.isdigit()):
                    ports.update(range(int(low), int(high or low) + 1))
        return ports

    def _inspect(self, name: str) -> dict | None:
        got = self._run_podman("network", "inspect", name)
        if got.returncode != 0:
            return None
        try:
            data = json.loads(got.stdout)
        except ValueError:
            return None
        return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None

    def _run_podman(self, *args: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self._podman, *args],
                env=self._env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StartError(f"podman {args[0]} {args[1]} failed: {exc}") from None

    def _ipt(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert self._iptables is not None
        try:
            return subprocess.run(
                [self._iptables, "-w", "10", *args],
                env={"PATH": _SBIN_PATH},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StartError(f"iptables failed: {exc}") from None

    def _rules(self, chain: str) -> list[str]:
        got = self._ipt("-S", chain)
        return [r for r in got.stdout.splitlines() if r.startswith("-A ")]

    def _add(self, chain: str, rule: list[str], *, first: bool = False) -> None:
        if self._ipt("-C", chain, *rule).returncode == 0:
            return
        got = self._ipt(*(["-I", chain, "1"] if first else ["-A", chain]), *rule)
        if got.returncode != 0:
            raise StartError(f"cannot add the tenant wall's rule to {chain}: {got.stderr.strip()}")

    def _wall(self, name: str, bridge: str) -> None:
        if self._iptables is None:
            raise StartError("iptables is not installed: the wall between tenants cannot be held")
        for chain in (FROM_TENANT_CHAIN, WALL_CHAIN):
            if self._ipt("-S", chain).returncode != 0:
                made = self._ipt("-N", chain)
                if made.returncode != 0 and self._ipt("-S", chain).returncode != 0:
                    raise StartError(f"cannot create iptables chain {chain}: {made.stderr.strip()}")
        tag = ["-m", "comment", "--comment", name]
        # In this order, so that no moment drops what stays within the bridge.
        self._add(FROM_TENANT_CHAIN, ["-i", bridge, "-o", bridge, *tag, "-j", "RETURN"], first=True)
        self._add(FROM_TENANT_CHAIN, ["-o", bridge, *tag, "-j", "DROP"])
        self._add(WALL_CHAIN, ["-i", bridge, *tag, "-j", FROM_TENANT_CHAIN])
        if not wall_leads(self._rules("FORWARD")):
            got = self._ipt("-I", "FORWARD", "1", "-j", WALL_CHAIN)
            if got.returncode != 0:
                raise StartError(f"cannot add the tenant wall to FORWARD: {got.stderr.strip()}")


# What may come before the wall's jump in FORWARD: netavark's isolation jump (netavark inserts
# it at the top whenever an isolated network starts a container; its chains only drop or
# return), and another copy of the wall's.
_HARMLESS_ABOVE = re.compile(rf"^-A FORWARD -j (NETAVARK_ISOLATION_\d+|{WALL_CHAIN})$")


def wall_leads(forward: list[str]) -> bool:
    """Whether the wall's jump is in FORWARD (`iptables -S` lines) before anything that could
    accept a packet. When not, it goes in again at the top: a copy further down is harmless
    (the wall's chains only drop or return), and removing it by number could race."""
    for rule in forward:
        if rule == f"-A FORWARD -j {WALL_CHAIN}":
            return True
        if not _HARMLESS_ABOVE.match(rule):
            return False
    return False


# One agent process makes one tenant's network at a time (other agents: see `ensure`).
_NETWORK_LOCK = threading.Lock()


class PodmanRuntime(ShimRuntime):
    name = "podman"
    own_uid = False  # root in its user namespace maps to an unnamed subordinate uid
    serves_ssh = True  # dropbear from the agent's bundle, published on the run's port

    def __init__(
        self,
        environ: Mapping[str, str] = os.environ,
        max_output: int | None = None,
        ssh_dir: Path | None = None,
    ):
        """`ssh_dir`: where the SSH server's bundle is built (`<state>/ssh-bundle`); None: no
        run with SSH keys can start."""
        self._environ = environ
        self._max_output = max_output
        self._ssh = SshBundle(ssh_dir, environ) if ssh_dir is not None else None

    def _podman(self) -> str:
        found = shutil.which("podman", path=self._environ.get("PATH"))
        if found is None:
            raise StartError("podman is not installed on this node")
        return found

    def networks(self) -> TenantNetworks:
        return TenantNetworks(self._podman(), self._environ)

    def capabilities(self) -> list[str]:
        """`ssh` where this host has what an SSH server in a container needs."""
        return ["ssh"] if self._ssh is not None and not self._ssh.missing() else []

    def forwarded_ports(self) -> set[int]:
        """The ports netavark's DNAT rules forward (`--dport` in its NETAVARK-HOSTPORT-DNAT
        chain of the nat table): a live container's, and ones netavark 1.4 left behind for a
        container gone (seen here: the first rule for a port wins, so a port with a stale
        rule never reaches a new container's server). Empty without iptables or the chain."""
        try:
            return self.networks().forwarded_ports()
        except StartError:  # no podman
            return set()

    def _ssh_bundle(self, assignment: Assignment, build: bool) -> Path | None:
        if not assignment.ssh_keys:
            return None
        if self._ssh is None:
            raise StartError("this node cannot bring an SSH server into a container")
        if not build:
            missing = self._ssh.missing()
            if missing:
                raise StartError(
                    "this node cannot bring an SSH server into a container: "
                    f"{', '.join(missing)} not installed"
                )
            return self._ssh.root / "current"
        return self._ssh.ensure()

    def check(self, assignment: Assignment) -> None:
        if assignment.ssh_keys and assignment.ssh_port is None:  # the agent picks it later
            assignment = assignment.model_copy(update={"ssh_port": 22})
        podman_argv(assignment, self._podman(), self._ssh_bundle(assignment, build=False))
        check_env(assignment.env)

    def launch(
        self,
        assignment: Assignment,
        env: dict[str, str],
        run_dir: Path,
        place: RunPlace,
        rec: RunRecord,
    ) -> subprocess.Popen:
        argv = podman_argv(assignment, self._podman(), self._ssh_bundle(assignment, build=True))
        argv = with_volumes(argv, place)
        full = {**assignment.env, **env}
        check_env(full)
        if assignment.tenant is not None:
            self.networks().ensure(assignment.tenant)
        # Podman applies the limits itself (--cpus, --memory): no cgroup of ours around it.
        return spawn_shim(
            argv,
            full,
            run_dir,
            exit_file=run_dir / EXIT_FILE,
            output=run_dir / OUTPUT_FILE,
            host_env=base_env(self._environ, PODMAN_ENV),
            cwd=place.workdir,
            env_fd=ENV_FD,
            max_output=self._max_output,
        )

    def signal(self, rec: RunRecord, sig: int) -> bool:
        """`podman run` proxies signals to the container, but a SIGKILL cannot be proxied:
        then the container is removed too."""
        sent = super().signal(rec, sig)
        if sig == signal.SIGKILL:
            self._remove(Assignment.model_validate(rec.assignment))
        return sent

    def _remove(self, assignment: Assignment) -> None:
        name = container_name(assignment)

        def kill() -> None:
            try:
                subprocess.run(
                    [self._podman(), "rm", "--force", "--time", "0", name],
                    env=base_env(self._environ, PODMAN_ENV),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=60,
                    check=False,
                )
            except (OSError, StartError, subprocess.TimeoutExpired) as exc:
                log.warning(kv("podman_kill_failed", container=name, error=exc))

        threading.Thread(target=kill, name=f"podman-rm-{name}", daemon=True).start()
