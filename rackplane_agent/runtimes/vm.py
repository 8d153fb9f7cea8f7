"""The `vm` runtime: the workload's disk image booted by QEMU (KVM where the host has it), under
the shim, so the run's exit, output and group signals work as every other runtime's.

What a run gets (`vm_argv`):

- its own **qcow2 overlay** over the image (`qemu-img create -f qcow2 -F qcow2 -b BASE`), in
  the run's working directory: the guest writes only there; the base image, which QEMU opens
  read-only as a backing file, is never written and is shared by every run of that image;
- a cloud-init **NoCloud seed** (`nocloud.py`: an ISO 9660 image labelled `cidata`, written in
  Python) with its instance id, its host name and the tenant's SSH public keys, for `root`
  (`disable_root: false`) as for the image's default user;
- `-device vfio-pci,host=<PCI address>` for each of its GPUs, each behind a PCIe root port of its
  own. The assignment names GPUs by UUID; the agent's inventory (`GpuInfo.pci_bus_id`) maps
  them to PCI addresses (`use_inventory`). A MIG instance cannot be passed through (it is no
  PCI function) and is refused;
- its **serial console** on QEMU's stdout, i.e. the run's output.log through the shim;
- a **QMP** socket in the run's state directory (the agent's, 0700; never in the tenant's
  working directory), through which a stop is an ACPI power button press (`system_powerdown`);
- user-mode networking with `restrict=on`: the guest reaches neither the host's loopback
  services (slirp maps 10.0.2.2 to the host) nor anything else; with SSH keys, the port of the
  node the agent picked from its `--ssh-ports` (`ssh_port`, never the control plane's) is
  forwarded to the guest's port 22 (`hostfwd`, on every address of the node), how a tenant
  logs in as `root`: the image's own SSH server (cloud-init's images have one) takes the keys
  from the seed, and the agent reports the run's SSH ready once a server greets on that port;
- KVM (`-enable-kvm -cpu host`) where /dev/kvm opens and the CPU has hardware virtualization
  (vmx/svm): a /dev/kvm without it (a paravirtual KVM such as PVM, which runs only guest kernels
  built for it) boots nothing else, so TCG (`-accel tcg`) is used there, as where /dev/kvm is
  missing. `RACKPLANE_VM_ACCEL=kvm|tcg` in the agent's environment overrides the choice
  (and `RACKPLANE_VM_PASSTHROUGH=none` boots VMs without their GPUs: for test hosts whose
  GPUs an inventory file describes);
- with `confidential` (`confidential-vm`), the SEV-SNP or TDX guest objects, when the host
  advertises that technology (kernel and QEMU both: `probe_host`), with the confidential
  firmware (OVMF) the guest must boot from; refused (`StartError`) elsewhere.

QEMU starts as the agent's user, which opens /dev/kvm, the VFIO groups, the disks and the QMP
socket, then drops to the run's own uid and gid (`-runas UID:GID`) before the guest runs: an
escape from the guest lands in an unprivileged uid holding nothing else on the node. QEMU's
environment is the agent's fixed basics: the workload's env reaches neither QEMU nor (yet) the
guest, and its `command` is not used (the image's own init runs).

Images: `Assignment.image` names a qcow2 file inside one of the node's image directories
(`RACKPLANE_VM_IMAGE_DIRS`, `:`-separated; default /var/lib/rackplane-images), by a path
relative to them or absolute; anything outside them is refused, so a tenant cannot boot (and
read) another file of the host. An image may carry a kernel for direct boot beside it, as
Firecracker's and Kata's images do: `NAME.vmlinuz`, `NAME.initrd` and `NAME.cmdline` next to
`NAME.qcow2`; without them the disk boots through the firmware.

Signals: SIGTERM is a QMP `system_powerdown` (the guest shuts down cleanly and QEMU exits 0),
falling back to SIGTERM to the run's group when QMP does not answer (QEMU then stops the guest
at once, also exiting 0); SIGKILL goes to the group, as for every runtime. Other signals are
not sent: they mean nothing to a guest, and QEMU dies of some (SIGUSR2) and stops the guest on
others (SIGINT, SIGHUP).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rackplane_agent.logfmt import kv
from rackplane_agent.runtimes.base import (
    RunPlace,
    RunUser,
    ShimRuntime,
    StartError,
    base_env,
    signal_group,
    spawn_shim,
)
from rackplane_agent.runtimes.nocloud import iso9660, seed_files
from rackplane_agent.state import EXIT_FILE, OUTPUT_FILE, RunRecord
from rackplane_wire import Assignment, Inventory

log = logging.getLogger("rackplane_agent.vm")

QEMU = "qemu-system-x86_64"
QEMU_IMG = "qemu-img"
DEFAULT_IMAGE_DIRS = ("/var/lib/rackplane-images",)
# Where the confidential guests' firmware is looked for, first found (Debian's `ovmf`; an
# SEV-SNP host wants an AmdSev build of OVMF, a TDX host a TDVF build).
FIRMWARE_CANDIDATES = ("/usr/share/ovmf/OVMF.fd", "/usr/share/OVMF/OVMF.fd")
OVERLAY_FILE = "disk.qcow2"
SEED_FILE = "seed.iso"
QMP_FILE = "qmp.sock"
DEFAULT_MEMORY_MIB = 1024
MIN_MEMORY_MIB = 256
QMP_TIMEOUT_S = 2.0
QCOW2_MAGIC = b"QFI\xfb"
# A Unix socket's path, as sockaddr_un holds it (108 bytes with the NUL).
MAX_SOCKET_PATH = 107
# What a 64-bit PCI BAR window must hold for GPUs passed through (an H100's BAR1 is 128 GiB).
PCI_HOLE64 = "2048G"
_PCI = re.compile(r"^(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])$")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9-]")


# --- the host ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostFeatures:
    """What this host's virtualization can do."""

    kvm: bool
    sev_snp: bool = False
    tdx: bool = False
    # SEV's C-bit position and the physical address bits it takes (CPUID 0x8000001F EBX).
    cbitpos: int = 51
    reduced_phys_bits: int = 1
    why_tcg: str | None = None  # why KVM is not used, when it is not

    @property
    def confidential(self) -> list[str]:
        return [name for name, has in (("sev-snp", self.sev_snp), ("tdx", self.tdx)) if has]


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _cpu_flags(cpuinfo: str) -> set[str]:
    for line in _read(cpuinfo).splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _kvm(dev: str, cpuinfo: str, forced: str | None) -> tuple[bool, str | None]:
    if forced == "tcg":
        return False, "RACKPLANE_VM_ACCEL=tcg"
    try:
        os.close(os.open(dev, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        if forced == "kvm":
            return True, None  # QEMU will say what it thinks
        return False, f"{dev} does not open ({exc.strerror})"
    flags = _cpu_flags(cpuinfo)
    if forced == "kvm" or flags & {"vmx", "svm"}:
        return True, None
    return False, f"{dev} opens but the CPU has no vmx/svm (a paravirtual KVM): TCG"


def _sev_bits(cpuid_dev: str = "/dev/cpu/0/cpuid") -> tuple[int, int] | None:
    """CPUID 0x8000001F EBX: the C-bit position (bits 5:0) and reduced physical bits (11:6)."""
    try:
        fd = os.open(cpuid_dev, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        regs = os.pread(fd, 16, 0x8000001F)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(regs) < 8:
        return None
    ebx = int.from_bytes(regs[4:8], "little")
    return ebx & 0x3F, (ebx >> 6) & 0x3F


def qemu_objects(qemu: str, env: Mapping[str, str]) -> set[str]:
    """The object types this QEMU can create (`-object help`)."""
    try:
        out = subprocess.run(
            [qemu, "-object", "help"],
            capture_output=True,
            text=True,
            timeout=20,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line.strip() for line in out.splitlines()[1:] if line.strip()}


def probe_host(
    qemu: str | None,
    environ: Mapping[str, str] = os.environ,
    *,
    dev_kvm: str = "/dev/kvm",
    cpuinfo: str = "/proc/cpuinfo",
    sys_module: str = "/sys/module",
) -> HostFeatures:
    """KVM, and the confidential technologies both the host's kernel and its QEMU offer."""
    forced = environ.get("RACKPLANE_VM_ACCEL") or None
    kvm, why = _kvm(dev_kvm, cpuinfo, forced)
    snp_kernel = _read(f"{sys_module}/kvm_amd/parameters/sev_snp") in ("Y", "1")
    tdx_kernel = _read(f"{sys_module}/kvm_intel/parameters/tdx") in ("Y", "1")
    objects = (
        qemu_objects(qemu, base_env(environ)) if qemu and (snp_kernel or tdx_kernel) else set()
    )
    bits = _sev_bits() if snp_kernel else None
    cbitpos, reduced = bits if bits and bits[0] else (51, 1)
    return HostFeatures(
        kvm=kvm,
        sev_snp=kvm and snp_kernel and "sev-snp-guest" in objects,
        tdx=kvm and tdx_kernel and "tdx-guest" in objects,
        cbitpos=cbitpos,
        reduced_phys_bits=reduced,
        why_tcg=why,
    )


# --- images ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VmImage:
    """A base disk image, with a kernel for direct boot when one lies beside it."""

    disk: Path
    kernel: Path | None = None
    initrd: Path | None = None
    cmdline: str | None = None


def image_dirs(environ: Mapping[str, str]) -> tuple[Path, ...]:
    wanted = environ.get("RACKPLANE_VM_IMAGE_DIRS")
    dirs = [d for d in wanted.split(os.pathsep) if d] if wanted else list(DEFAULT_IMAGE_DIRS)
    return tuple(Path(d) for d in dirs)


def resolve_image(name: str | None, dirs: tuple[Path, ...]) -> VmImage:
    """The image `name` names: a qcow2 file inside one of `dirs` (symlinks resolved first)."""
    if not name:
        raise StartError("the vm runtime needs an image (a qcow2 disk image on the node)")
    candidates = [Path(name)] if os.path.isabs(name) else [d / name for d in dirs]
    roots = [d.resolve() for d in dirs]
    for candidate in candidates:
        real = candidate.resolve()
        if not any(real == r or r in real.parents for r in roots):
            continue
        if not real.is_file():
            continue
        try:
            with open(real, "rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise StartError(f"image {name} cannot be read: {exc.strerror}") from None
        if magic != QCOW2_MAGIC:
            raise StartError(f"image {name} is not a qcow2 image")
        kernel = real.with_suffix(".vmlinuz")
        initrd = real.with_suffix(".initrd")
        cmdline = real.with_suffix(".cmdline")
        has_kernel = kernel.is_file()
        return VmImage(
            disk=real,
            kernel=kernel if has_kernel else None,
            initrd=initrd if has_kernel and initrd.is_file() else None,
            cmdline=cmdline.read_text().strip() if has_kernel and cmdline.is_file() else None,
        )
    where = ", ".join(str(d) for d in dirs)
    raise StartError(f"image {name} is not in this node's image directories ({where})")


# --- the command line ---------------------------------------------------------------------------


def pci_address(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` (or sysfs's `0000:3b:00.0`) as VFIO's `0000:3b:00.0`."""
    m = _PCI.match(bus_id.strip())
    if m is None:
        raise StartError(f"not a PCI address: {bus_id!r}")
    domain = int(m.group(1) or "0", 16)
    if domain > 0xFFFF:
        raise StartError(f"PCI domain of {bus_id!r} is out of range")
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def memory_mib(assignment: Assignment) -> int:
    if assignment.memory_mib <= 0:
        return DEFAULT_MEMORY_MIB
    return max(MIN_MEMORY_MIB, assignment.memory_mib)


def vcpus(assignment: Assignment) -> int:
    return max(1, math.ceil(assignment.cpu_milli / 1000))


def hostname(assignment: Assignment) -> str:
    if assignment.hostname:
        return assignment.hostname
    return ("rp-" + _NAME_UNSAFE.sub("-", assignment.workload_id))[:63].rstrip("-")


def gpu_addresses(assignment: Assignment, pci_bus_ids: Mapping[str, str]) -> list[str]:
    """The PCI address of each of the run's GPUs, in its order. Raises StartError."""
    out = []
    for device in assignment.devices:
        if device.startswith("MIG-"):
            raise StartError(f"{device} is a MIG instance: only whole GPUs pass through to a VM")
        bus_id = pci_bus_ids.get(device)
        if not bus_id:
            raise StartError(
                f"GPU {device} has no PCI bus id in this node's inventory: it cannot be passed "
                "through"
            )
        out.append(pci_address(bus_id))
    return out


@dataclass(frozen=True)
class VmPaths:
    overlay: Path
    seed: Path
    qmp: Path


def confidential_machine(
    assignment: Assignment,
    host: HostFeatures,
    image: VmImage,
    firmware: Path | None,
    memory: int,
) -> tuple[list[str], list[str]]:
    """The `-machine` options and `-object` arguments of a confidential guest (SEV-SNP, TDX)."""
    machine = ["q35"]
    objects: list[str] = []
    if assignment.confidential is None:
        return machine, objects
    tech = assignment.confidential
    offered = host.confidential
    if tech not in offered:
        has = f"it offers only {', '.join(offered)}" if offered else "it offers neither"
        raise StartError(
            f"a confidential VM with {tech} cannot run on this host: {has} of SEV-SNP and "
            "TDX (the host's kernel and QEMU must both support it)"
        )
    if firmware is None:
        raise StartError(f"a confidential VM ({tech}) needs OVMF firmware: none found")
    if tech == "sev-snp":
        machine += ["confidential-guest-support=sev0", "memory-backend=ram0"]
        snp = f"sev-snp-guest,id=sev0,cbitpos={host.cbitpos}"
        snp += f",reduced-phys-bits={host.reduced_phys_bits}"
        if image.kernel is not None:
            snp += ",kernel-hashes=on"  # the direct-boot kernel is measured too
        objects += [
            "-object",
            f"memory-backend-memfd,id=ram0,size={memory}M,share=true,prealloc=false",
            "-object",
            snp,
        ]
    else:
        machine += ["kernel-irqchip=split", "confidential-guest-support=tdx0"]
        objects += ["-object", "tdx-guest,id=tdx0"]
    return machine, objects


def accel_args(host: HostFeatures) -> list[str]:
    """KVM with the host's CPU where the host has it, else TCG."""
    if host.kvm:
        return ["-enable-kvm", "-cpu", "host"]
    return ["-accel", "tcg"]


def direct_boot_args(image: VmImage) -> list[str]:
    """The kernel, initrd and command line an image carries for direct boot (none: [])."""
    if image.kernel is None:
        return []
    argv = ["-kernel", str(image.kernel)]
    if image.initrd is not None:
        argv += ["-initrd", str(image.initrd)]
    return argv + ["-append", image.cmdline or "console=ttyS0"]


def disk_and_net_args(assignment: Assignment, image: VmImage, paths: VmPaths) -> list[str]:
    """The run's overlay disk and seed, and its restricted user-mode network (SSH forwarded)."""
    return [
        "-drive",
        f"file={paths.overlay},format=qcow2,if=none,id=disk0,discard=unmap",
        "-device",
        # The disk boots first, unless a direct-boot kernel (which takes boot index 0) does.
        "virtio-blk-pci,drive=disk0" + ("" if image.kernel is not None else ",bootindex=0"),
        "-drive",
        f"file={paths.seed},format=raw,if=none,id=seed0,readonly=on",
        "-device",
        "virtio-blk-pci,drive=seed0",
        "-netdev",
        "user,id=net0,restrict=on"
        + (f",hostfwd=tcp::{assignment.ssh_port}-:22" if assignment.ssh_port else ""),
        "-device",
        "virtio-net-pci,netdev=net0",
    ]


def passthrough_args(gpus: list[str]) -> list[str]:
    """Each GPU (by PCI address) passed through with VFIO, behind a PCIe root port of its own."""
    argv: list[str] = []
    for i, address in enumerate(gpus):
        argv += [
            "-device",
            f"pcie-root-port,id=gpu{i}-port,bus=pcie.0,chassis={i + 1},slot={i + 1}",
            "-device",
            f"vfio-pci,host={address},bus=gpu{i}-port",
        ]
    return argv


def vm_argv(
    assignment: Assignment,
    *,
    image: VmImage,
    paths: VmPaths,
    host: HostFeatures,
    pci_bus_ids: Mapping[str, str] = {},  # noqa: B006 (read only)
    user: RunUser | None = None,
    firmware: Path | None = None,
    qemu: str = QEMU,
    passthrough: bool = True,
) -> list[str]:
    """QEMU's command line for a run. Raises StartError for what this host cannot give it.
    `passthrough` False: the run's GPUs are not passed through (a test host whose GPUs an
    inventory file describes: there is nothing to pass)."""
    memory, cpus = memory_mib(assignment), vcpus(assignment)
    gpus = gpu_addresses(assignment, pci_bus_ids) if passthrough else []
    machine, objects = confidential_machine(assignment, host, image, firmware, memory)
    argv = [qemu, "-name", hostname(assignment), "-nodefaults", "-no-user-config"]
    argv += ["-display", "none", "-no-reboot"]
    argv += accel_args(host)
    argv += ["-machine", ",".join(machine), *objects]
    if gpus:
        argv += ["-global", f"q35-pcihost.pci-hole64-size={PCI_HOLE64}"]
    if firmware is not None and assignment.confidential is not None:
        argv += ["-bios", str(firmware)]
    argv += ["-m", f"{memory}M", "-smp", str(cpus)]
    argv += direct_boot_args(image)
    argv += disk_and_net_args(assignment, image, paths)
    argv += passthrough_args(gpus)
    argv += ["-chardev", "stdio,id=console0,signal=off", "-serial", "chardev:console0"]
    argv += ["-qmp", f"unix:{paths.qmp},server=on,wait=off"]
    if user is not None:
        argv += ["-runas", f"{user.uid}:{user.gid}"]
    return argv


# --- QMP ---------------------------------------------------------------------------------------


class QmpError(Exception):
    """QEMU's monitor did not answer, or refused the command."""


def qmp_execute(path: Path, command: str, timeout: float = QMP_TIMEOUT_S) -> Any:
    """Run one QMP command (after the capabilities handshake); its `return`."""
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            reader = sock.makefile("rb")

            def message() -> dict[str, Any]:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                line = reader.readline()
                if not line:
                    raise QmpError("QMP closed the connection")
                return json.loads(line)

            if "QMP" not in message():
                raise QmpError("no QMP greeting")
            result: Any = None
            for execute in ("qmp_capabilities", command):
                sock.sendall(json.dumps({"execute": execute}).encode() + b"\n")
                while True:  # events (POWERDOWN, SHUTDOWN ...) may come before the answer
                    msg = message()
                    if "error" in msg:
                        raise QmpError(f"{execute}: {msg['error'].get('desc', msg['error'])}")
                    if "return" in msg:
                        result = msg["return"]
                        break
            return result
    except (OSError, ValueError) as exc:
        raise QmpError(str(exc) or type(exc).__name__) from None


# --- the runtime -------------------------------------------------------------------------------


@dataclass
class _Found:
    qemu: str
    qemu_img: str
    host: HostFeatures


class VmRuntime(ShimRuntime):
    name = "vm"
    serves_ssh = True  # the guest's own SSH server, forwarded from the run's port

    def __init__(
        self,
        environ: Mapping[str, str] = os.environ,
        max_output: int | None = None,
        *,
        pci_bus_ids: Mapping[str, str] | None = None,
        images: tuple[Path, ...] | None = None,
        host: HostFeatures | None = None,
        firmware: Path | None = None,
    ):
        """`pci_bus_ids`: GPU UUID -> PCI bus id (else from `use_inventory`); `images`: the
        image directories (else from the environment); `host`: what the host can do (else
        probed on first use); `firmware`: OVMF for confidential guests (else the first of
        FIRMWARE_CANDIDATES found)."""
        self.environ = environ
        self.max_output = max_output
        self.pci_bus_ids = dict(pci_bus_ids or {})
        self.images = images if images is not None else image_dirs(environ)
        self.host = host
        self.firmware = firmware or next(
            (Path(p) for p in FIRMWARE_CANDIDATES if os.path.isfile(p)), None
        )
        self._found: _Found | None = None
        # RACKPLANE_VM_PASSTHROUGH=none: GPUs are described (an inventory file), not real, so
        # nothing is passed through; for test hosts only, and said in the agent's log.
        self.passthrough = environ.get("RACKPLANE_VM_PASSTHROUGH", "vfio") != "none"
        if not self.passthrough:
            log.warning(kv("vm_passthrough_off", reason="RACKPLANE_VM_PASSTHROUGH=none"))

    # --- what the host has --------------------------------------------------------------

    def _tools(self) -> _Found:
        if self._found is None:
            path = self.environ.get("PATH")
            qemu, qemu_img = shutil.which(QEMU, path=path), shutil.which(QEMU_IMG, path=path)
            if qemu is None or qemu_img is None:
                raise StartError(f"QEMU is not installed on this node ({QEMU}, {QEMU_IMG})")
            host = self.host or probe_host(qemu, self.environ)
            if not host.kvm:
                log.warning(kv("vm_without_kvm", reason=host.why_tcg))
            self._found = _Found(qemu, qemu_img, host)
        return self._found

    def use_inventory(self, inventory: Inventory) -> None:
        """The GPUs' PCI bus ids, as the agent's inventory reported them."""
        self.pci_bus_ids = {g.uuid: g.pci_bus_id for g in inventory.gpus if g.pci_bus_id}

    def capabilities(self) -> list[str]:
        """The confidential technologies this host can launch (`sev-snp`, `tdx`)."""
        try:
            return self._tools().host.confidential if self.firmware is not None else []
        except StartError:
            return []

    # --- the verbs ----------------------------------------------------------------------

    def _argv(self, assignment: Assignment, paths: VmPaths, user: RunUser | None) -> list[str]:
        found = self._tools()
        return vm_argv(
            assignment,
            image=resolve_image(assignment.image, self.images),
            paths=paths,
            host=found.host,
            pci_bus_ids=self.pci_bus_ids,
            user=user,
            firmware=self.firmware,
            qemu=found.qemu,
            passthrough=self.passthrough,
        )

    def check(self, assignment: Assignment) -> None:
        where = Path("/nonexistent")
        self._argv(assignment, VmPaths(where, where, where), None)

    def launch(
        self,
        assignment: Assignment,
        env: dict[str, str],
        run_dir: Path,
        place: RunPlace,
        rec: RunRecord,
    ) -> subprocess.Popen:
        paths = VmPaths(
            overlay=place.workdir / OVERLAY_FILE,
            seed=place.workdir / SEED_FILE,
            qmp=run_dir.absolute() / QMP_FILE,
        )
        if len(os.fsencode(paths.qmp)) > MAX_SOCKET_PATH:
            raise StartError(
                f"the QMP socket path {paths.qmp} is longer than a Unix socket's "
                f"{MAX_SOCKET_PATH} bytes: use a shorter state directory"
            )
        argv = self._argv(assignment, paths, place.user)
        image = resolve_image(assignment.image, self.images)
        host_env = base_env(self.environ)
        self._overlay(image.disk, paths.overlay, host_env)
        files = seed_files(f"rp-{rec.key}", hostname(assignment), list(assignment.ssh_keys))
        fd = os.open(paths.seed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(iso9660(files))
        if place.user is not None:  # the run's files are its own
            for path in (paths.overlay, paths.seed):
                os.chown(path, place.user.uid, place.user.gid)
        paths.qmp.unlink(missing_ok=True)
        # QEMU runs as the agent's user until -runas, in the agent's fixed environment; the
        # workload's env is not given to it.
        return spawn_shim(
            argv,
            host_env,
            run_dir,
            exit_file=run_dir / EXIT_FILE,
            output=run_dir / OUTPUT_FILE,
            host_env=host_env,
            cwd=place.workdir,
            max_output=self.max_output,
        )

    def _overlay(self, base: Path, overlay: Path, env: dict[str, str]) -> None:
        argv = [self._tools().qemu_img, "create", "-q", "-f", "qcow2", "-F", "qcow2"]
        argv += ["-b", str(base), str(overlay)]
        try:
            done = subprocess.run(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise StartError(f"cannot create the run's disk overlay: {exc}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip()[:500]
            raise StartError(f"cannot create the run's disk overlay: {detail}")

    def signal(self, rec: RunRecord, sig: int) -> bool:
        if sig == signal.SIGTERM:
            if not self.running(rec):
                return False
            try:
                qmp_execute(rec.run_dir / QMP_FILE, "system_powerdown")
            except QmpError as exc:
                log.warning(kv("vm_powerdown_unanswered", run=rec.key, error=exc))
                return signal_group(rec.pid, signal.SIGTERM)
            log.info(kv("vm_powerdown", run=rec.key))
            return True
        if sig == signal.SIGKILL:
            return signal_group(rec.pid, sig)
        log.info(kv("vm_signal_not_sent", run=rec.key, signal=signal.Signals(sig).name))
        return self.running(rec)
