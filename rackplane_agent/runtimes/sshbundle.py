"""The SSH server the `podman` runtime brings into a container one logs into (a run with SSH
keys): the host's dropbear, with every library it loads and the loader itself, in a directory
mounted read-only at /.rackplane/ssh. It needs nothing of the image but /bin/sh (no sshd, no
glibc: the loader and the libraries come along, and dropbear runs as
`ld.so --library-path /.rackplane/ssh/lib /.rackplane/ssh/dropbear`).

    <state>/ssh-bundle/<digest>/
        init            the container's command before the workload's (INIT below)
        dropbear        /usr/sbin/dropbear's bytes
        dropbearkey     /usr/bin/dropbearkey's bytes
        ld.so           the loader ldd names for them (/lib64/ld-linux-x86-64.so.2)
        lib/<soname>    each library ldd lists for them (the bytes of the file it resolves to)

`<digest>` names what went in (the sources' paths, sizes, times and inodes, and the init
script): a dropbear or a libc upgraded on the host gives a new directory on the next such run's
start, and a container started earlier keeps the one it mounted. The previous one is kept too
(a container may be starting on it), older ones go. Files are 0755/0644, the directories 0755:
the container's root, an unprivileged id of the host, reads them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from rackplane_agent.logfmt import kv
from rackplane_agent.runtimes.base import StartError

log = logging.getLogger("rackplane_agent.sshbundle")

MOUNT = "/.rackplane/ssh"
INIT = f"{MOUNT}/init"
# What the container's SSH server is, in the container: dropbear as root on port 22, passwords
# off (-s), logging into /tmp/.rackplane-ssh/log (-E: to stderr), a host key of its own made
# at start (ed25519), whose fingerprint goes to the run's output for its tenant to check. Then
# the workload's command, as the container's main process (dropbear has forked into the
# background), with the umask it came with. Only /bin/sh, its builtins and mkdir are used: no
# awk, sed or grep needed.
INIT_SCRIPT = f"""#!/bin/sh
# Rackplane: an SSH server for this container (the node agent brings it, {MOUNT}).
b={MOUNT}
s=/tmp/.rackplane-ssh
h=
if [ -r /etc/passwd ]; then
  while IFS=: read -r n x u g c d r; do
    if [ "$n" = root ]; then h=$d; break; fi
  done </etc/passwd
fi
h=${{h:-/root}}
(umask 077 && mkdir -p "$h/.ssh" && printf '%s\\n' "$RACKPLANE_SSH_KEYS" >"$h/.ssh/authorized_keys")
unset RACKPLANE_SSH_KEYS
(umask 077 && mkdir -p "$s" && @KEY@ -t ed25519 -f "$s/key" >/dev/null 2>&1)
@KEY@ -y -f "$s/key" 2>/dev/null | while read -r a f; do
  if [ "$a" = Fingerprint: ]; then echo "RACKPLANE-SSH-HOSTKEY $f"; fi
done
@DROPBEAR@ -s -E -p 22 -P "$s/pid" -r "$s/key" 2>>"$s/log"
if [ $# -eq 0 ]; then
  while :; do sleep 3600; done
fi
exec "$@"
"""
# Where the tools are looked for first (Debian's dropbear-bin), then on PATH.
DROPBEAR = "/usr/sbin/dropbear"
DROPBEARKEY = "/usr/bin/dropbearkey"
_SEARCH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"
_LIB = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x[0-9a-fA-F]+\)\s*$")
_LOADER = re.compile(r"^\s*(/\S+)\s+\(0x[0-9a-fA-F]+\)\s*$")
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found")
_KEEP = 2  # bundles kept: the newest and the one before it


def _which(name: str, default: str, path: str | None) -> str | None:
    if os.path.isfile(default) and os.access(default, os.X_OK):
        return default
    return shutil.which(name, path=f"{path}:{_SEARCH}" if path else _SEARCH)


def parse_ldd(text: str) -> tuple[dict[str, str], str | None]:
    """ldd's output -> ({soname: path}, the loader's path or None). Raises StartError for a
    library ldd cannot find."""
    libs: dict[str, str] = {}
    loader = None
    for line in text.splitlines():
        missing = _NOT_FOUND.match(line)
        if missing:
            raise StartError(f"ldd cannot find {missing.group(1)} for the SSH server")
        m = _LIB.match(line)
        if m:
            libs[m.group(1)] = m.group(2)
            continue
        m = _LOADER.match(line)
        if m:
            loader = m.group(1)
    return libs, loader


class SshBundle:
    """The bundle directory under `root` (`<state>/ssh-bundle`), built on first use and again
    when what goes into it changed."""

    def __init__(self, root: Path, environ: Mapping[str, str] = os.environ):
        self.root = Path(root)
        self._path = environ.get("PATH")
        self._lock = threading.Lock()

    def tools(self) -> dict[str, str | None]:
        return {
            "dropbear": _which("dropbear", DROPBEAR, self._path),
            "dropbearkey": _which("dropbearkey", DROPBEARKEY, self._path),
            "ldd": _which("ldd", "/usr/bin/ldd", self._path),
        }

    def missing(self) -> list[str]:
        """The tools this host lacks to bring an SSH server (none: it can)."""
        return [name for name, path in self.tools().items() if path is None]

    def _ldd(self, ldd: str, binary: str) -> tuple[dict[str, str], str | None]:
        try:
            done = subprocess.run(
                [ldd, binary],
                env={"PATH": _SEARCH, "LANG": "C"},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise StartError(f"ldd {binary} failed: {exc}") from None
        if "not a dynamic executable" in done.stdout + done.stderr:
            return {}, None  # static: runs as it is
        if done.returncode != 0:
            raise StartError(f"ldd {binary} failed: {(done.stderr or done.stdout).strip()[:300]}")
        return parse_ldd(done.stdout)

    def ensure(self) -> Path:
        """The current bundle's directory (built if missing). Raises StartError."""
        found = self.tools()
        lacking = [name for name, path in found.items() if path is None]
        if lacking:
            raise StartError(
                "this node cannot bring an SSH server into a container: "
                f"{', '.join(lacking)} not installed (Debian: dropbear-bin, libc-bin)"
            )
        ldd = found["ldd"]
        assert ldd is not None
        binaries = {n: found[n] for n in ("dropbear", "dropbearkey")}
        libs: dict[str, str] = {}
        loader = None
        static: set[str] = set()
        for name, binary in binaries.items():
            assert binary is not None
            got, their_loader = self._ldd(ldd, binary)
            libs.update(got)
            if their_loader is None and not got:
                static.add(name)
            loader = loader or their_loader
        if len(static) < len(binaries) and loader is None:
            raise StartError("ldd names no loader for dropbear: cannot bring it into a container")
        sources: dict[str, str] = {n: str(b) for n, b in binaries.items()}
        sources.update({f"lib/{soname}": path for soname, path in sorted(libs.items())})
        if loader is not None:
            sources["ld.so"] = loader
        run = {
            name: f"$b/{name}" if name in static else f"$b/ld.so --library-path $b/lib $b/{name}"
            for name in binaries
        }
        script = INIT_SCRIPT.replace("@KEY@", run["dropbearkey"])
        script = script.replace("@DROPBEAR@", run["dropbear"])
        digest = hashlib.sha256(script.encode())
        for dest, src in sorted(sources.items()):
            try:
                real = os.path.realpath(src)
                st = os.stat(real)
            except OSError as exc:
                raise StartError(f"cannot read {src} for the SSH server: {exc}") from None
            digest.update(f"{dest}|{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}\n".encode())
        target = self.root / digest.hexdigest()[:16]
        with self._lock:
            if not (target / "init").is_file():
                self._build(target, sources, script)
                self._prune(target)
        return target

    def _build(self, target: Path, sources: dict[str, str], script: str) -> None:
        self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        tmp = self.root / f".build-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            (tmp / "lib").mkdir(mode=0o755, parents=True)
            for dest, src in sources.items():
                path = tmp / dest
                shutil.copyfile(os.path.realpath(src), path)
                os.chmod(path, 0o644 if dest.startswith("lib/") else 0o755)
            (tmp / "init").write_text(script)
            os.chmod(tmp / "init", 0o755)
            os.chmod(tmp, 0o755)
            os.chmod(tmp / "lib", 0o755)
            shutil.rmtree(target, ignore_errors=True)  # a half-built one (no init)
            os.rename(tmp, target)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            why = f"cannot build the SSH server's bundle in {self.root}: {exc}"
            raise StartError(why) from None
        log.info(kv("ssh_bundle_built", dir=target, files=len(sources) + 1))

    def _prune(self, current: Path) -> None:
        others = [
            p for p in self.root.iterdir() if p.is_dir() and p != current and p.name[0] != "."
        ]
        others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for old in others[_KEEP - 1 :]:
            shutil.rmtree(old, ignore_errors=True)
