"""Real rootful podman containers for the `container` tier's tests and bench: Debian's podman 4.3
with runc (scripts/ensure-podman.sh installs them), a private configuration and storage under a
directory the test owns, and an image built here from busybox-static (never pulled).

    d = Path(tmp) ; image = build_image(d, "rpbox")        # localhost/rpbox:test
    podman(d, "run", "--rm", "--user", "1000:1000", ..., "--", image, "id")

Why the configuration is what it is (docs/design/containers-here.md has the errors verbatim):
  - runtime runc: this host is cgroup v1, which crun refuses (an earlier probe; Debian's podman
    pulls in runc only, crun is not installed).
  - default_ulimits = []: root here lacks CAP_SYS_RESOURCE (it is not in the bounding set), so
    runc cannot raise RLIMIT_NOFILE / RLIMIT_NPROC to what podman asks for by default ("error
    setting rlimit type 7: operation not permitted"). With the list empty podman sets no rlimit
    and the container inherits the caller's. A `--ulimit` must then name both nofile and nproc,
    at or under the caller's hard limits (naming only one makes podman add the other at its max).
  - cgroup_manager cgroupfs (no systemd here), events_logger file (no journald).
  - storage, runroot, libpod's tmp_dir, networks' configs and the events log all under `dir`, so
    tests neither see nor disturb the host's podman. Not private: the aardvark-dns state in
    /run/containers/networks, the iptables rules, the bridges (podmanN) - all per host.
  - the default network and the pool `podman network create` draws from are in POOL
    (10.213.0.0/16), so `isolate_pool()` can drop traffic between any two of them. (The
    agent's podman runtime needs no such help: it keeps a wall of its own between tenants'
    bridges, `rackplane_agent.runtimes.podman.TenantNetworks`; tests/agent/test_container_wall.py.)

Verified on 2026-11-28 (Debian 12, kernel 6.18, podman 4.3.1, runc 1.1.5, netavark 1.4.0,
iptables 1.8.9 nf_tables, busybox-static 1.35.0, dropbear 2022.83), as root, with
CONTAINERS_CONF / CONTAINERS_STORAGE_CONF from `env(d)`:

    podman run --rm --runtime runc --user 1000:1000 --security-opt no-new-privileges \\
        --cap-drop all --read-only localhost/rpbox:test id
      -> uid=1000(tenant) gid=1000(tenant) groups=1000(tenant)
    podman run --rm --userns=auto localhost/rpbox:test cat /proc/self/uid_map
      -> 0 2147483647 1024   (needs "containers:2147483647:2147483648" in /etc/subuid and
         /etc/subgid, which ensure-podman.sh adds; without it: "Cannot find mappings for user
         \\"containers\\": no subuid ranges found ... could not find enough available IDs").
         Two live containers got disjoint ranges (2147483647+1024, 2147484671+1024).
         The automatic size covers the image's file owners and --user (1024 here; 65535 with
         --user 65534:65534); past 65536 it fails ("the container needs a user namespace with
         size ... bigger than the maximum value allowed with userns=auto") unless sized:
         `--userns=auto:size=N`.
    podman run --rm --uidmap 0:100000:65536 --gidmap 0:100000:65536 IMAGE id
      -> works with no /etc/subuid entry at all.
    podman network create --opt isolate=true tenant-a   (netavark backend, iptables-nft)
      -> two `isolate=true` networks cannot reach each other (nc: timed out) - until the last
         container of ANY isolated network goes away: netavark 1.4 then deletes the
         `FORWARD -j NETAVARK_ISOLATION_1` jump and the rest reach each other again (seen).
         Plain networks (no isolate) always reach each other by IP (routed via the host).
         `isolate_pool()` (a FORWARD rule of ours) holds regardless: A->B nc timed out,
         A->A' (same network) and host->B still answer.
    podman run --rm --env-file F IMAGE sh -c 'echo $FOO'   -> `FOO=bar baz` kept whole,
         `K=a=b` splits at the first "=", `# comments` skipped, `E=` gives an empty value.
    podman run --rm --user 1000:1000 -- IMAGE echo ok      -> `--` before the image: accepted.
         (`podman run IMAGE -- echo` runs "--": exit 127, "executable file not found".)
    SSH: `build_image(d, "rpssh", ssh=True)` + `sshd(pubkey)` -> `ssh -p 2222 tenant@<ip>` logs
         in, with --userns=auto --user 1000:1000 --cap-drop all --read-only no-new-privileges.
         (The agent's own instances bring dropbear from the host into the plain image instead:
         `ssh_args(key, "127.0.0.1", user="root", port=<the run's ssh_port>)` logs into them;
         tests/agent/test_container_wall.py.)
    `podman run --rm IMAGE true`, median of 5 (2 vCPUs, warm, host otherwise quiet): 0.39 s on
         the default network, 0.31 s on a tenant network, 0.22 s with --network none; hardened
         + --userns=auto: 0.21 s (none) / 0.33 s (tenant network). With the host busy (load 2):
         0.54 / 0.59 / 0.38 s (median of 7). build_image: 0.5 s (0.7 s with ssh), 0.07 s cached.

A `podman run` on a DNS-enabled network prints "failed to connect to syslog: Initialization" on
stderr: aardvark-dns starting with no /dev/log. Noise, not a failure (`network(dns=False)`, i.e.
--disable-dns, has none; the container's resolv.conf then names the host's resolver).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

PODMAN = shutil.which("podman") or "/usr/bin/podman"
BUSYBOX = "/bin/busybox"  # busybox-static's; Debian's plain busybox is dynamically linked
DROPBEAR = "/usr/sbin/dropbear"
CATATONIT = "/usr/libexec/podman/catatonit"  # podman's default init_path, for --init
IPTABLES = shutil.which("iptables", path="/usr/sbin:/sbin:/usr/bin:/bin") or "/usr/sbin/iptables"
POOL = "10.213.0.0/16"
DEFAULT_SUBNET = "10.213.255.0/24"
ISOLATION_CHAIN = "RACKPLANE_TEST_ISOLATION"
TENANT_UID = 1000
SSH_PORT = 2222


def available() -> str | None:
    """Why these containers cannot run here (for a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "rootful podman needs root"
    # catatonit: the agent's podman runtime runs every container with --init; iptables: its
    # wall between tenants' networks.
    for tool in (PODMAN, "/usr/sbin/runc", BUSYBOX, CATATONIT, IPTABLES):
        if not Path(tool).exists():
            return f"{tool} is missing (scripts/ensure-podman.sh installs it)"
    return None


def containers_conf(dir: Path | str) -> Path:
    """Write `dir`/containers.conf and `dir`/storage.conf (idempotent); the former's path."""
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("graph", "run", "libpod-tmp", "networks"):
        (d / sub).mkdir(exist_ok=True)
    conf = d / "containers.conf"
    conf.write_text(
        f"""\
[containers]
default_ulimits = []
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{d}/events.log"
tmp_dir = "{d}/libpod-tmp"

[network]
network_backend = "netavark"
network_config_dir = "{d}/networks"
default_network = "rackplane-test"
default_subnet = "{DEFAULT_SUBNET}"
default_subnet_pools = [{{"base" = "{POOL}", "size" = 24}}]
"""
    )
    (d / "storage.conf").write_text(
        f"""\
[storage]
driver = "overlay"
graphroot = "{d}/graph"
runroot = "{d}/run"
"""
    )
    return conf


def env(dir: Path | str) -> dict[str, str]:
    """The variables that point podman at `dir`'s configuration (merge them into os.environ)."""
    d = Path(dir).resolve()
    if not (d / "containers.conf").exists():
        containers_conf(d)
    return {
        "CONTAINERS_CONF": str(d / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(d / "storage.conf"),
        # `podman import` stages the tarball in image_copy_tmp_dir (/var/tmp by default).
        "TMPDIR": str(d / "libpod-tmp"),
    }


def podman(
    dir: Path | str, *args: str, check: bool = True, timeout: float = 120, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `podman args...` against `dir`'s configuration; output captured as text."""
    r = subprocess.run(
        [PODMAN, *args],
        env={**os.environ, **env(dir)},
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
    return r


# The image ----------------------------------------------------------------------------------

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    f"tenant:x:{TENANT_UID}:{TENANT_UID}:tenant:/home/tenant:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = f"root:x:0:\ntenant:x:{TENANT_UID}:\nnogroup:x:65534:\n"
SHADOW = "root:*:1::::::\ntenant:*:1::::::\nnobody:*:1::::::\n"


def _applets() -> list[str]:
    out = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout
    return sorted(a for a in out.split() if a and a != "busybox" and "/" not in a)


def _shared_libs(binary: str) -> list[str]:
    """The files `binary` loads (ldd's resolved paths, the loader included)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return sorted({m for m in re.findall(r"(/\S+)", out) if Path(m).exists()})


def _rootfs(ssh: bool, files: Mapping[str, bytes | str]) -> tuple[bytes, str]:
    """The rootfs as an uncompressed tarball (built in memory, owners set in the headers, so no
    staging directory and no chown), and a digest of what went into it."""
    buf = io.BytesIO()
    digest = hashlib.sha256()
    made: set[str] = set()

    def add(
        name: str,
        data: bytes | None = None,
        mode: int = 0o644,
        uid: int = 0,
        kind: bytes = tarfile.REGTYPE,
        link: str = "",
    ) -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.uid, ti.gid, ti.linkname, ti.mtime = kind, mode, uid, uid, link, 0
        if data is not None:
            ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data) if data is not None else None)
        digest.update(f"{name}|{mode:o}|{uid}|{kind!r}|{link}|".encode())
        digest.update(hashlib.sha256(data or b"").digest())

    def directory(name: str, mode: int = 0o755, uid: int = 0) -> None:
        if name not in made:
            made.add(name)
            add(name, mode=mode, uid=uid, kind=tarfile.DIRTYPE)

    def parents(path: str) -> None:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            directory("/".join(parts[:i]))

    def file(path: str, data: bytes, mode: int = 0o644) -> None:
        path = path.lstrip("/")
        parents(path)
        add(path, data=data, mode=mode)

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("bin", "etc", "dev", "proc", "sys", "run", "home", "usr", "var"):
            directory(name)
        directory("root", 0o700)
        directory("tmp", 0o1777)
        directory("var/tmp", 0o1777)
        directory("home/tenant", 0o755, TENANT_UID)
        file("bin/busybox", Path(BUSYBOX).read_bytes(), 0o755)
        for a in _applets():
            add(f"bin/{a}", kind=tarfile.SYMTYPE, link="busybox")
        file("etc/passwd", PASSWD.encode())
        file("etc/group", GROUP.encode())
        file("etc/shadow", SHADOW.encode(), 0o600)
        if ssh:
            # dropbear is dynamically linked (libtomcrypt, libtommath, libz, libcrypt, libgmp,
            # libc, ld-linux): copy each at the path ldd names, the symlinks' targets' bytes.
            # glibc >= 2.34 has nss_files built in: getpwnam() needs no libnss_*.
            for f in [DROPBEAR, *_shared_libs(DROPBEAR)]:
                file(f, Path(f).resolve().read_bytes(), 0o755)
            directory("etc/dropbear")
        for name, content in sorted(files.items()):
            data = content.encode() if isinstance(content, str) else content
            file(name, data, 0o755 if data.startswith(b"#!") else 0o644)
    return buf.getvalue(), digest.hexdigest()[:16]


def build_image(
    dir: Path | str, name: str, *, ssh: bool = False, files: Mapping[str, bytes | str] = {}
) -> str:
    """`localhost/<name>:test`, imported from a busybox-static rootfs: /bin/busybox and a link per
    applet (sh, cat, ls, id, sleep, nc, wget, httpd, ip, ...), /etc/passwd with root, tenant
    (uid 1000) and nobody, /tmp. `ssh`: dropbear and its libraries too (see `sshd`). `files`:
    extra paths -> contents (a test's own layout; "#!" files are made executable). Built once:
    the image carries a label with the rootfs's digest and is rebuilt only when that changes."""
    d = Path(dir).resolve()
    containers_conf(d)
    ref = f"localhost/{name}:test"
    with open(d / f".build-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data, digest = _rootfs(ssh, files)
        have = podman(d, "image", "inspect", ref, check=False)
        old_id = None
        if have.returncode == 0:
            info = json.loads(have.stdout)[0]
            if (info.get("Labels") or {}).get("rackplane.rootfs") == digest:
                return ref
            old_id = info["Id"]
        _import(d, data, ref, digest)
        if old_id:
            podman(d, "image", "rm", old_id, check=False)
    return ref


def _import(d: Path, data: bytes, ref: str, digest: str) -> None:
    tarball = d / "libpod-tmp" / f"rootfs-{digest}.tar"
    tarball.write_bytes(data)
    try:
        podman(
            d,
            "import",
            "--change",
            'CMD ["/bin/sh"]',
            "--change",
            "ENV PATH=/bin:/usr/sbin",
            "--change",
            f"LABEL rackplane.rootfs={digest}",
            str(tarball),
            ref,
        )
    finally:
        tarball.unlink(missing_ok=True)


# SSH ----------------------------------------------------------------------------------------


def sshd(pubkey: str, *, user: str = "tenant", port: int = SSH_PORT) -> tuple[list[str], list[str]]:
    """(podman run options, command after the image) for dropbear serving `user` by `pubkey`, in
    a container that may be --read-only, --cap-drop all, --user 1000:1000, --userns=auto:
    dropbear runs as that user (it can then log in only as itself), $HOME and /etc/dropbear are
    tmpfs chowned to it (`U`; `notmpcopyup` so nothing of the image's shows through), the host
    key is made on the first connection (-R), passwords are off (-s)."""
    opts = [
        "--tmpfs",
        f"/home/{user}:rw,U",
        "--tmpfs",
        "/etc/dropbear:rw,U,notmpcopyup",
        "--env",
        f"SSH_PUBKEY={pubkey.strip()}",
    ]
    script = (
        'mkdir -p -m 700 "$HOME/.ssh"'
        ' && printf "%s\\n" "$SSH_PUBKEY" > "$HOME/.ssh/authorized_keys"'
        ' && chmod 600 "$HOME/.ssh/authorized_keys"'
        f" && exec /usr/sbin/dropbear -F -E -s -R -p {port}"
    )
    return opts, ["sh", "-c", script]


def ssh_args(key: Path | str, ip: str, *, user: str = "tenant", port: int = SSH_PORT) -> list[str]:
    """OpenSSH client arguments for such a container (no known_hosts, no prompts)."""
    return [
        "ssh",
        "-i",
        str(key),
        "-p",
        str(port),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "BatchMode=yes",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=5",
        f"{user}@{ip}",
    ]


# Networks -----------------------------------------------------------------------------------


def network(
    dir: Path | str,
    name: str,
    *,
    subnet: str | None = None,
    internal: bool = False,
    dns: bool = True,
) -> str:
    """Create (if missing) a bridge network for one tenant, with netavark's isolate=true; its
    subnet comes from POOL unless given. Pair it with `isolate_pool()`: netavark 1.4's own
    isolation is lost when any isolated network's last container stops."""
    if podman(dir, "network", "exists", name, check=False).returncode != 0:
        args = ["network", "create", "--opt", "isolate=true"]
        if subnet:
            args += ["--subnet", subnet]
        if internal:
            args.append("--internal")
        if not dns:
            args.append("--disable-dns")
        podman(dir, *args, name)
    return name


def ip_of(dir: Path | str, container: str) -> str:
    fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
    return podman(dir, "inspect", "-f", fmt, container).stdout.split()[0]


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=check)


def isolate_pool(pool: str = POOL) -> None:
    """Drop what is routed from one network of `pool` to another (idempotent). Traffic inside
    one bridge is bridged, not routed (br_netfilter shows it to FORWARD with physdev
    is-bridged), so it passes; host <-> container goes through INPUT/OUTPUT, untouched."""
    if _iptables("-S", ISOLATION_CHAIN, check=False).returncode != 0:
        _iptables("-N", ISOLATION_CHAIN)
    _iptables("-F", ISOLATION_CHAIN)
    _iptables("-A", ISOLATION_CHAIN, "-m", "physdev", "--physdev-is-bridged", "-j", "RETURN")
    _iptables("-A", ISOLATION_CHAIN, "-s", pool, "-d", pool, "-j", "DROP")
    if _iptables("-C", "FORWARD", "-j", ISOLATION_CHAIN, check=False).returncode != 0:
        _iptables("-I", "FORWARD", "1", "-j", ISOLATION_CHAIN)


def unisolate_pool() -> None:
    while _iptables("-D", "FORWARD", "-j", ISOLATION_CHAIN, check=False).returncode == 0:
        pass
    _iptables("-F", ISOLATION_CHAIN, check=False)
    _iptables("-X", ISOLATION_CHAIN, check=False)


def cleanup(dir: Path | str, networks: Sequence[str] = ()) -> None:
    """Remove every container of `dir`'s podman, then the named networks (images stay cached)."""
    podman(dir, "rm", "--all", "--force", "--time", "0", check=False)
    for n in networks:
        podman(dir, "network", "rm", "--force", n, check=False)
