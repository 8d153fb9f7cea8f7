"""The `vm` runtime's test guest, built here and cached between runs (issue 44 §2); the tests
and `rackplane bench instances` boot it.

A Debian kernel (unpacked, not installed, by scripts/ensure-qemu.sh) boots a busybox initramfs
directly (`-kernel`/`-initrd`, the way Firecracker and Kata boot theirs), with an empty qcow2
disk as the image the runtime overlays. Its /init:

- mounts proc, sys and devtmpfs and loads the few modules it needs (virtio disks and network,
  ISO 9660 for the seed, the ACPI button and evdev for the power button);
- finds the NoCloud seed (the virtio disk holding `meta-data`), takes its host name and writes
  the SSH keys of its user-data into /root/.ssh/authorized_keys;
- writes a line into its own disk (the run's overlay: the base must not change);
- prints `RACKPLANE-GUEST-UP hostname=NAME keys=N`;
- starts dropbear on port 22 over user-mode networking (10.0.2.15);
- powers off (`poweroff -f`, so QEMU exits 0 with `-no-reboot`) on an ACPI power button
  event, i.e. QMP `system_powerdown`, printing `RACKPLANE-GUEST-POWER-BUTTON` first.

`build()` returns the image (`guest-<hash>.qcow2` with `.vmlinuz`, `.initrd` and `.cmdline`
beside it, the way the runtime finds a direct-boot kernel) or raises `Unavailable` with the
reason, which the tests skip on.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path("/var/cache/rackplane-test-guest")
UP_MARKER = "RACKPLANE-GUEST-UP"
BUTTON_MARKER = "RACKPLANE-GUEST-POWER-BUTTON"
DISK_MARKER = b"RACKPLANE-GUEST-WROTE-HERE"
# What /init loads, in this order (each with its dependencies, read from the modules).
MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "isofs", "button", "evdev")
CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=3"

INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /seed /root/.ssh /etc/dropbear /var/log /bin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
for m in $(cat /etc/modules.order); do insmod "/lib/modules/$m.ko" 2>/dev/null; done
# The power button: any event from it powers the guest off.
watch_button() {
  for i in /sys/class/input/input*; do
    grep -q "Power Button" "$i/name" 2>/dev/null || continue
    for e in "$i"/event*; do
      [ -e "$e" ] || continue
      ev=/dev/input/$(basename "$e")
      ( dd if="$ev" bs=24 count=1 >/dev/null 2>&1
        echo "RACKPLANE-GUEST-POWER-BUTTON"; sync; poweroff -f ) &
    done
  done
}
n=0
while [ $n -lt 50 ] && ! ls /sys/class/input/input*/event* >/dev/null 2>&1; do
  sleep 0.1; n=$((n + 1))
done
watch_button
# The NoCloud seed: the disk that mounts as ISO 9660 with a meta-data file.
seed=""
n=0
while [ -z "$seed" ] && [ $n -lt 50 ]; do
  for d in /dev/vd?; do
    [ -b "$d" ] || continue
    if mount -t iso9660 -o ro "$d" /seed 2>/dev/null; then
      if [ -f /seed/meta-data ]; then seed=$d; break; fi
      umount /seed
    fi
  done
  [ -n "$seed" ] || { sleep 0.1; n=$((n + 1)); }
done
name=$(sed -n 's/^local-hostname: *//p' /seed/meta-data | tr -d "'\"")
[ -n "$name" ] && hostname "$name"
sed -n 's/^- //p' /seed/user-data | tr -d "'\"" > /root/.ssh/authorized_keys
chmod 700 /root/.ssh && chmod 600 /root/.ssh/authorized_keys
keys=$(grep -c . /root/.ssh/authorized_keys)
# The image's own disk (the run's overlay): written, so the test can see the base was not.
for d in /dev/vd?; do
  [ "$d" = "$seed" ] && continue
  echo "RACKPLANE-GUEST-WROTE-HERE" | dd of="$d" conv=notrunc 2>/dev/null && sync
  break
done
echo "RACKPLANE-GUEST-UP hostname=$(hostname) keys=$keys seed=$seed"
if ip link set eth0 up 2>/dev/null; then
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
  dropbear -R -E -p 22 2>/var/log/dropbear.log
fi
while true; do sleep 3600; done
"""


def has_ssh_server() -> bool:
    """Whether the guest gets dropbear (the host's, when it has one), and so answers on 22."""
    return os.path.exists(shutil.which("dropbear") or "/usr/sbin/dropbear")


class Unavailable(Exception):
    """The guest cannot be built here (the reason is the skip message)."""


@dataclass(frozen=True)
class Guest:
    image: Path  # the base qcow2; .vmlinuz, .initrd and .cmdline beside it
    kernel_version: str


def cache_dir() -> Path:
    wanted = os.environ.get("RACKPLANE_TEST_GUEST_CACHE")
    return Path(wanted) if wanted else DEFAULT_CACHE


def _kernel(cache: Path) -> tuple[Path, Path]:
    linux = cache / "linux"
    kernels = sorted((linux / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise Unavailable(
            f"no guest kernel under {linux} (run scripts/ensure-qemu.sh, which unpacks "
            "Debian's linux-image-amd64 there)"
        )
    kernel = kernels[-1]
    version = kernel.name.removeprefix("vmlinuz-")
    modules = linux / "lib" / "modules" / version
    if not modules.is_dir():
        raise Unavailable(f"no modules for kernel {version} under {modules}")
    return kernel, modules


def _module_index(modules: Path) -> dict[str, Path]:
    index = {}
    for path in (modules / "kernel").rglob("*.ko"):
        index[path.name[:-3].replace("-", "_")] = path
    return index


def _depends(path: Path) -> list[str]:
    """A module's `depends=` (from its .modinfo strings; no depmod needed)."""
    data = path.read_bytes()
    at = data.find(b"\x00depends=")
    if at < 0:
        return []
    end = data.index(b"\x00", at + 1)
    value = data[at + len(b"\x00depends=") : end].decode()
    return [d.replace("-", "_") for d in value.split(",") if d]


def _load_order(index: dict[str, Path], wanted: tuple[str, ...]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        path = index.get(name)
        if path is None:
            return  # built into the kernel
        for dep in _depends(path):
            visit(dep)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


def _libraries(binary: str) -> list[Path]:
    """The shared libraries (and loader) a binary needs, from ldd."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        for part in parts:
            if part.startswith("/") and Path(part).exists():
                libs.append(Path(part))
    return libs


class _Cpio:
    """A `newc` cpio archive, as the kernel unpacks an initramfs."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1
        self.dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        name_b = name.encode() + b"\x00"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0]
        header = b"070701" + b"".join(f"{v:08X}".encode() for v in fields)
        self.ino += 1
        self.buf.write(header + name_b)
        self.buf.write(b"\x00" * (-(len(header) + len(name_b)) % 4))
        self.buf.write(data + b"\x00" * (-len(data) % 4))

    def mkdir(self, name: str) -> None:
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            path = "/".join(parts[:i])
            if path not in self.dirs:
                self.dirs.add(path)
                self._entry(path, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        if "/" in name:
            self.mkdir(name.rsplit("/", 1)[0])
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        if "/" in name:
            self.mkdir(name.rsplit("/", 1)[0])
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def close(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _initramfs(modules: Path) -> bytes:
    busybox = Path("/bin/busybox")
    if not busybox.is_file():
        raise Unavailable("no /bin/busybox (busybox-static; run scripts/ensure-qemu.sh)")
    ldd = subprocess.run(["ldd", str(busybox)], capture_output=True, text=True, check=False)
    if "not a dynamic" not in ldd.stdout + ldd.stderr:
        raise Unavailable("/bin/busybox is not static (install busybox-static)")
    index = _module_index(modules)
    order = _load_order(index, MODULES)
    archive = _Cpio()
    for d in ("bin", "sbin", "dev", "proc", "sys", "tmp", "etc", "root", "lib/modules"):
        archive.mkdir(d)
    archive.file("bin/busybox", busybox.read_bytes(), 0o755)
    archive.symlink("bin/sh", "busybox")
    archive.file("init", INIT.encode(), 0o755)
    archive.file("etc/modules.order", ("\n".join(order) + "\n").encode())
    for name in order:
        archive.file(f"lib/modules/{name}.ko", index[name].read_bytes())
    archive.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    archive.file("etc/group", b"root:x:0:\n")
    archive.file("etc/shells", b"/bin/sh\n")
    dropbear = shutil.which("dropbear") or "/usr/sbin/dropbear"
    if os.path.exists(dropbear):
        archive.file("bin/dropbear", Path(dropbear).read_bytes(), 0o755)
        for lib in _libraries(dropbear):
            archive.file(str(lib), lib.read_bytes(), 0o755)
    return gzip.compress(archive.close(), compresslevel=6, mtime=0)


def build(cache: Path | None = None) -> Guest:
    """The guest image, built once per input (kernel, modules, busybox, init) and cached."""
    if shutil.which("qemu-img") is None or shutil.which("qemu-system-x86_64") is None:
        raise Unavailable("QEMU is not installed (run scripts/ensure-qemu.sh)")
    cache = cache or cache_dir()
    kernel, modules = _kernel(cache)
    digest = hashlib.sha256()
    for part in (INIT.encode(), "|".join(MODULES).encode(), CMDLINE.encode(), kernel.name.encode()):
        digest.update(part)
    for tool in ("/bin/busybox", shutil.which("dropbear") or "/usr/sbin/dropbear"):
        if os.path.exists(tool):
            digest.update(hashlib.sha256(Path(tool).read_bytes()).digest())
    images = cache / "images"
    stem = images / f"guest-{digest.hexdigest()[:16]}"
    image = stem.with_suffix(".qcow2")
    if not image.exists():
        try:
            images.mkdir(parents=True, exist_ok=True)
            tmp = images / f".{stem.name}.{os.getpid()}"
            tmp.mkdir(exist_ok=True)
            (tmp / "initrd").write_bytes(_initramfs(modules))
            shutil.copyfile(kernel, tmp / "vmlinuz")
            (tmp / "cmdline").write_text(CMDLINE + "\n")
            subprocess.run(
                ["qemu-img", "create", "-q", "-f", "qcow2", str(tmp / "disk.qcow2"), "16M"],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            raise Unavailable(f"cannot build the test guest in {images}: {exc}") from None
        for suffix, name in (
            (".vmlinuz", "vmlinuz"),
            (".initrd", "initrd"),
            (".cmdline", "cmdline"),
        ):
            os.replace(tmp / name, stem.with_suffix(suffix))
        os.replace(tmp / "disk.qcow2", image)  # last: its presence means the set is whole
        shutil.rmtree(tmp, ignore_errors=True)
    return Guest(image=image, kernel_version=kernel.name.removeprefix("vmlinuz-"))
