"""The `vm` runtime (issue 44 §2): QEMU's command line, the NoCloud seed, QMP, and one real boot.

The command-line tests need nothing: GPUs pass through by the PCI bus id the inventory reported,
each run boots its own overlay, its seed and its QMP socket are where the agent alone reaches
them, KVM where the host has it, and a confidential VM gets its objects or a clear refusal.

The real boot runs the test guest (rackplane_bench/vmguest.py: a Debian kernel and a busybox
initramfs) through an in-process agent, as root with a uid per run: the run reports running with
the SSH port the agent picked, its console shows the host name from the seed, QEMU runs as the
run's uid, the agent reports the guest's SSH server ready and the tenant's key logs in as root
through that port (another key does not), the base image is unchanged, and removing the
assignment powers the guest off through QMP within the grace, a clean exit (0), not a kill.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from rackplane_agent import runtimes
from rackplane_agent.runtimes import nocloud
from rackplane_agent.runtimes.base import RunUser, StartError
from rackplane_agent.runtimes.vm import (
    HostFeatures,
    VmImage,
    VmPaths,
    VmRuntime,
    probe_host,
    qmp_execute,
    resolve_image,
    vm_argv,
)
from rackplane_agent.state import RunRecord
from rackplane_bench import vmguest
from rackplane_wire import GpuInfo, Inventory
from tests.fixtures.agent import (
    GPU0,
    GPU1,
    MIG0,
    FakeClient,
    agent,
    assignment,
    assignments,
    open_dir,
    step_until,
    wait_until,
)

pytestmark = pytest.mark.no_db

VM = "00000000-0000-4000-8000-0000000000b1"
KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop"
)
KEY2 = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY= bob"
SSH_PORTS = (22400, 22449)  # the real boot's agent's --ssh-ports
PATHS = VmPaths(Path("/w/run/disk.qcow2"), Path("/w/run/seed.iso"), Path("/s/runs/r/qmp.sock"))
IMAGE = VmImage(disk=Path("/images/base.qcow2"))
KVM = HostFeatures(kvm=True)
TCG = HostFeatures(kvm=False, why_tcg="no /dev/kvm")
BUS = {GPU0: "00000000:3B:00.0", GPU1: "0000:86:00.0"}


def _vm(**kw):
    return assignment(VM, [], **{"runtime": "vm", "image": "base.qcow2", **kw})


def _after(argv: list[str], flag: str) -> list[str]:
    """Every value that follows `flag` in argv."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


# --- the command line ---------------------------------------------------------------------------


def test_gpus_pass_through_by_the_pci_bus_id_the_inventory_reported():
    argv = vm_argv(_vm(devices=[GPU1, GPU0]), image=IMAGE, paths=PATHS, host=KVM, pci_bus_ids=BUS)
    devices = _after(argv, "-device")
    vfio = [d for d in devices if d.startswith("vfio-pci")]
    # In the run's order, NVML's 8-digit domain as VFIO's 4, each behind a root port of its own.
    assert vfio == [
        "vfio-pci,host=0000:86:00.0,bus=gpu0-port",
        "vfio-pci,host=0000:3b:00.0,bus=gpu1-port",
    ]
    assert [d for d in devices if d.startswith("pcie-root-port")] == [
        "pcie-root-port,id=gpu0-port,bus=pcie.0,chassis=1,slot=1",
        "pcie-root-port,id=gpu1-port,bus=pcie.0,chassis=2,slot=2",
    ]
    assert "q35-pcihost.pci-hole64-size=2048G" in _after(argv, "-global")
    none = vm_argv(_vm(), image=IMAGE, paths=PATHS, host=KVM, pci_bus_ids=BUS)
    assert not [d for d in _after(none, "-device") if "vfio" in d] and "-global" not in none


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        ([MIG0], "MIG instance"),
        (["GPU-99999999-9999-9999-9999-999999999999"], "no PCI bus id"),
    ],
)
def test_a_gpu_that_cannot_pass_through_is_refused(devices, words):
    with pytest.raises(StartError, match=words):
        vm_argv(_vm(devices=devices), image=IMAGE, paths=PATHS, host=KVM, pci_bus_ids=BUS)


def test_the_run_boots_its_overlay_its_seed_and_answers_on_its_qmp_socket():
    argv = vm_argv(_vm(), image=IMAGE, paths=PATHS, host=KVM)
    drives = _after(argv, "-drive")
    assert drives == [
        "file=/w/run/disk.qcow2,format=qcow2,if=none,id=disk0,discard=unmap",
        "file=/w/run/seed.iso,format=raw,if=none,id=seed0,readonly=on",
    ]
    assert str(IMAGE.disk) not in " ".join(argv)  # the base only as the overlay's backing file
    assert _after(argv, "-qmp") == ["unix:/s/runs/r/qmp.sock,server=on,wait=off"]
    # The serial console on stdout (the run's output.log), nothing else of a display.
    assert _after(argv, "-chardev") == ["stdio,id=console0,signal=off"]
    assert _after(argv, "-serial") == ["chardev:console0"]
    assert {"-nodefaults", "-no-user-config", "-no-reboot"} <= set(argv)
    assert _after(argv, "-display") == ["none"]
    # User-mode networking that reaches neither the host's loopback nor anything else.
    assert _after(argv, "-netdev") == ["user,id=net0,restrict=on"]
    assert "-runas" not in argv and "-kernel" not in argv
    assert "virtio-blk-pci,drive=disk0,bootindex=0" in _after(argv, "-device")
    # With an SSH port, that port of the node reaches the guest's sshd, and nothing else does.
    ssh = vm_argv(_vm(ssh_port=22001), image=IMAGE, paths=PATHS, host=KVM)
    assert _after(ssh, "-netdev") == ["user,id=net0,restrict=on,hostfwd=tcp::22001-:22"]
    # A direct-boot kernel beside the image; QEMU drops to the run's uid once it has opened all.
    direct = VmImage(IMAGE.disk, Path("/images/base.vmlinuz"), Path("/images/base.initrd"), "x=1")
    user = RunUser(uid=2_000_123, gid=3_000)
    argv = vm_argv(_vm(), image=direct, paths=PATHS, host=KVM, user=user)
    assert _after(argv, "-kernel") == ["/images/base.vmlinuz"]
    assert _after(argv, "-initrd") == ["/images/base.initrd"]
    assert _after(argv, "-append") == ["x=1"]
    assert _after(argv, "-runas") == ["2000123:3000"]
    assert "virtio-blk-pci,drive=disk0" in _after(argv, "-device")  # the kernel boots first


def test_kvm_where_the_host_has_it_else_tcg():
    kvm = vm_argv(_vm(), image=IMAGE, paths=PATHS, host=KVM)
    assert "-enable-kvm" in kvm and _after(kvm, "-cpu") == ["host"] and "-accel" not in kvm
    tcg = vm_argv(_vm(), image=IMAGE, paths=PATHS, host=TCG)
    assert _after(tcg, "-accel") == ["tcg"] and "-enable-kvm" not in tcg and "-cpu" not in tcg


def test_kvm_needs_a_kvm_device_and_hardware_virtualization(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    env = {"PATH": os.environ.get("PATH", "")}
    cpuinfo.write_text("flags\t\t: fpu sse2 vmx avx\n")
    got = probe_host(None, env, dev_kvm=str(tmp_path / "missing"), cpuinfo=str(cpuinfo))
    assert got.kvm is False and "does not open" in got.why_tcg
    kvm = tmp_path / "kvm"  # a file that opens read-write stands in for the device
    kvm.write_text("")
    assert probe_host(None, env, dev_kvm=str(kvm), cpuinfo=str(cpuinfo)).kvm is True
    # A paravirtual KVM (this kind of host: /dev/kvm is PVM) boots no stock kernel: TCG.
    cpuinfo.write_text("flags\t\t: fpu sse2 hypervisor avx\n")
    got = probe_host(None, env, dev_kvm=str(kvm), cpuinfo=str(cpuinfo))
    assert got.kvm is False and "no vmx/svm" in got.why_tcg
    forced = probe_host(None, {**env, "RACKPLANE_VM_ACCEL": "tcg"}, dev_kvm=str(kvm))
    assert forced.kvm is False


def test_memory_and_cpus_come_from_the_assignment_with_sane_minimums():
    def sizes(**kw):
        argv = vm_argv(_vm(**kw), image=IMAGE, paths=PATHS, host=KVM)
        return _after(argv, "-m")[0], _after(argv, "-smp")[0]

    assert sizes(memory_mib=8192, cpu_milli=4000) == ("8192M", "4")
    assert sizes(memory_mib=16, cpu_milli=500) == ("256M", "1")  # at least 256 MiB, 1 vCPU
    assert sizes(cpu_milli=2500) == ("1024M", "3")  # unset memory: 1 GiB; vCPUs round up


def test_a_confidential_vm_is_refused_where_the_host_offers_neither():
    with pytest.raises(StartError, match="offers neither of SEV-SNP and TDX"):
        vm_argv(_vm(confidential="sev-snp"), image=IMAGE, paths=PATHS, host=KVM)
    snp_only = HostFeatures(kvm=True, sev_snp=True)
    with pytest.raises(StartError, match="tdx cannot run on this host: it offers only sev-snp"):
        vm_argv(
            _vm(confidential="tdx"), image=IMAGE, paths=PATHS, host=snp_only, firmware=Path("/f")
        )
    with pytest.raises(StartError, match="needs OVMF firmware"):
        vm_argv(_vm(confidential="sev-snp"), image=IMAGE, paths=PATHS, host=snp_only)


def test_a_confidential_vm_gets_the_guest_objects_of_its_technology():
    ovmf = Path("/usr/share/ovmf/OVMF.fd")
    host = HostFeatures(kvm=True, sev_snp=True, tdx=True, cbitpos=51, reduced_phys_bits=1)
    snp = vm_argv(
        _vm(confidential="sev-snp", memory_mib=4096),
        image=IMAGE,
        paths=PATHS,
        host=host,
        firmware=ovmf,
    )
    assert _after(snp, "-machine") == ["q35,confidential-guest-support=sev0,memory-backend=ram0"]
    assert _after(snp, "-object") == [
        "memory-backend-memfd,id=ram0,size=4096M,share=true,prealloc=false",
        "sev-snp-guest,id=sev0,cbitpos=51,reduced-phys-bits=1",
    ]
    assert _after(snp, "-bios") == [str(ovmf)] and "-enable-kvm" in snp
    direct = VmImage(IMAGE.disk, Path("/k"), None, None)
    measured = vm_argv(
        _vm(confidential="sev-snp"), image=direct, paths=PATHS, host=host, firmware=ovmf
    )
    assert _after(measured, "-object")[1].endswith(",kernel-hashes=on")
    tdx = vm_argv(_vm(confidential="tdx"), image=IMAGE, paths=PATHS, host=host, firmware=ovmf)
    assert _after(tdx, "-machine") == ["q35,kernel-irqchip=split,confidential-guest-support=tdx0"]
    assert _after(tdx, "-object") == ["tdx-guest,id=tdx0"] and _after(tdx, "-bios") == [str(ovmf)]
    plain = vm_argv(_vm(), image=IMAGE, paths=PATHS, host=host, firmware=ovmf)
    assert _after(plain, "-machine") == ["q35"] and "-bios" not in plain and "-object" not in plain


def test_this_host_advertises_no_confidential_technology():
    """This machine's kernel offers neither (kvm_amd.sev_snp, kvm_intel.tdx), so the runtime
    advertises nothing and refuses a confidential run with the reason."""
    host = probe_host(shutil.which("qemu-system-x86_64"))
    if host.confidential:
        pytest.skip(f"this host offers {host.confidential}")
    rt = VmRuntime({"PATH": os.environ.get("PATH", "")}, host=host, images=(Path("/"),))
    assert rt.capabilities() == []


def test_the_runtime_takes_the_pci_bus_ids_from_the_inventory():
    rt = VmRuntime({}, host=KVM)
    inv = Inventory(
        hostname="n",
        address="10.0.0.1",
        source="file",
        gpus=[
            GpuInfo(index=0, uuid=GPU0, model="H100-80GB", pci_bus_id="00000000:3B:00.0"),
            GpuInfo(index=1, uuid=GPU1, model="H100-80GB"),
        ],
        agent_version="0.1.0",
    )
    rt.use_inventory(inv)
    assert rt.pci_bus_ids == {GPU0: "00000000:3B:00.0"}


# --- images -------------------------------------------------------------------------------------


def test_an_image_is_a_qcow2_file_inside_the_nodes_image_directories(tmp_path):
    images, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    images.mkdir()
    elsewhere.mkdir()
    (images / "ubuntu.qcow2").write_bytes(b"QFI\xfb" + b"\0" * 60)
    (elsewhere / "secret.qcow2").write_bytes(b"QFI\xfb" + b"\0" * 60)
    (images / "raw.img").write_bytes(b"\0" * 64)
    (images / "escape.qcow2").symlink_to(elsewhere / "secret.qcow2")
    dirs = (images,)
    assert resolve_image("ubuntu.qcow2", dirs) == VmImage(images / "ubuntu.qcow2")
    assert resolve_image(str(images / "ubuntu.qcow2"), dirs).disk == images / "ubuntu.qcow2"
    for name in (str(elsewhere / "secret.qcow2"), "escape.qcow2", "../elsewhere/secret.qcow2"):
        with pytest.raises(StartError, match="not in this node's image directories"):
            resolve_image(name, dirs)
    with pytest.raises(StartError, match="not a qcow2 image"):
        resolve_image("raw.img", dirs)
    with pytest.raises(StartError, match="needs an image"):
        resolve_image(None, dirs)
    # A kernel for direct boot beside it.
    (images / "ubuntu.vmlinuz").write_bytes(b"k")
    (images / "ubuntu.initrd").write_bytes(b"i")
    (images / "ubuntu.cmdline").write_text("console=ttyS0 quiet\n")
    got = resolve_image("ubuntu.qcow2", dirs)
    assert (got.kernel, got.initrd, got.cmdline) == (
        images / "ubuntu.vmlinuz",
        images / "ubuntu.initrd",
        "console=ttyS0 quiet",
    )


# --- the NoCloud seed ---------------------------------------------------------------------------


def _joliet_files(iso: bytes) -> dict[str, bytes]:
    """The root directory of an ISO's Joliet tree, read back (names without `;1`)."""
    svd = iso[17 * 2048 : 18 * 2048]
    assert svd[0] == 2 and svd[1:6] == b"CD001" and svd[88:91] == b"%/E"
    root = svd[156:190]
    extent = int.from_bytes(root[2:6], "little")
    data = iso[extent * 2048 : (extent + 1) * 2048]
    files, at = {}, 0
    while at < len(data) and data[at]:
        length, name_len = data[at], data[at + 32]
        name = data[at + 33 : at + 33 + name_len]
        if name not in (b"\x00", b"\x01"):
            start = int.from_bytes(data[at + 2 : at + 6], "little") * 2048
            size = int.from_bytes(data[at + 10 : at + 14], "little")
            files[name.decode("utf-16-be").removesuffix(";1")] = iso[start : start + size]
        at += length
    return files


def test_the_seed_carries_the_instance_its_host_name_and_the_tenants_keys(tmp_path):
    files = nocloud.seed_files("rp-w.0.0", "tenant-box", [KEY, KEY2])
    assert files["meta-data"] == b"instance-id: rp-w.0.0\nlocal-hostname: tenant-box\n"
    user = files["user-data"].decode()
    assert user.startswith("#cloud-config\n")
    assert f"\n- {KEY}\n- {KEY2}\n" in user  # one line each, never folded
    assert "\ndisable_root: false\n" in user  # root takes them too (one logs in as root)
    iso = nocloud.iso9660(files)
    assert len(iso) % 2048 == 0
    pvd = iso[16 * 2048 : 17 * 2048]
    assert pvd[0] == 1 and pvd[1:6] == b"CD001" and pvd[40:72].rstrip() == b"cidata"
    assert _joliet_files(iso) == files
    if shutil.which("blkid"):  # util-linux's own reading of it
        path = tmp_path / "seed.iso"
        path.write_bytes(iso)
        out = subprocess.run(
            ["blkid", "-p", "-o", "export", str(path)], capture_output=True, text=True
        )
        assert "TYPE=iso9660" in out.stdout and "LABEL=cidata" in out.stdout, out


# --- signals: QMP powerdown, else SIGTERM ------------------------------------------------------


class FakeQmp:
    """A QMP server on a Unix socket: greets, answers every command, records them."""

    def __init__(self, path: Path):
        self.path = path
        self.commands: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn, conn.makefile("rwb") as f:
            f.write(b'{"QMP": {"version": {}, "capabilities": ["oob"]}}\n')
            f.flush()
            for line in f:
                command = json.loads(line)["execute"]
                self.commands.append(command)
                if command == "system_powerdown":  # an event first, as QEMU sends it
                    f.write(b'{"event": "POWERDOWN", "timestamp": {}}\n')
                f.write(b'{"return": {}}\n')
                f.flush()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def run_group(tmp_path):
    """A stand-in run: a process group led by a sleeping process, and its record."""
    run_dir = open_dir("rp-vmsig-")
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    rec = RunRecord(VM, 0, 0, {"runtime": "vm"}, pid=proc.pid, run_dir=run_dir, popen=proc)
    yield rec, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(run_dir, ignore_errors=True)


def test_sigterm_is_a_qmp_powerdown(run_group):
    rec, proc = run_group
    qmp = FakeQmp(rec.run_dir / "qmp.sock")
    try:
        assert VmRuntime({}, host=KVM).signal(rec, signal.SIGTERM) is True
        wait_until(lambda: qmp.commands == ["qmp_capabilities", "system_powerdown"], timeout=5)
        time.sleep(0.2)
        assert proc.poll() is None  # the guest shuts down on its own: no signal to QEMU
    finally:
        qmp.close()


def test_sigterm_goes_to_the_group_when_qmp_does_not_answer(run_group):
    rec, proc = run_group
    assert VmRuntime({}, host=KVM).signal(rec, signal.SIGTERM) is True  # no socket at all
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_other_signals_do_not_reach_qemu_and_sigkill_does(run_group):
    rec, proc = run_group
    rt = VmRuntime({}, host=KVM)
    assert rt.signal(rec, signal.SIGUSR2) is True  # QEMU would die of it: not sent
    time.sleep(0.2)
    assert proc.poll() is None
    assert rt.signal(rec, signal.SIGKILL) is True
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_qmp_execute_reports_a_socket_nobody_listens_on(tmp_path):
    from rackplane_agent.runtimes.vm import QmpError

    with pytest.raises(QmpError):
        qmp_execute(tmp_path / "none.sock", "system_powerdown", timeout=0.5)


# --- registration -------------------------------------------------------------------------------


def test_vm_is_offered_where_qemu_is_installed(monkeypatch):
    installed = {"qemu-system-x86_64", "qemu-img"}
    monkeypatch.setattr(runtimes.shutil, "which", lambda name: name if name in installed else None)
    assert runtimes.available() == ["process", "vm"]
    assert runtimes.available(["process", "vm"]) == ["process", "vm"]
    assert isinstance(runtimes.make("vm", {}), VmRuntime)
    installed.discard("qemu-img")
    assert runtimes.available() == ["process"]
    with pytest.raises(ValueError, match="'vm' is not available"):
        runtimes.available(["vm"])


def test_an_agent_refuses_a_vm_it_cannot_give(tmp_path, monkeypatch):
    """Through the runner: an image outside the image directories, and a confidential VM on a
    host that advertises neither technology, fail to start with the reason."""
    if not (shutil.which("qemu-system-x86_64") and shutil.which("qemu-img")):
        pytest.skip("QEMU is not installed (scripts/ensure-qemu.sh)")
    images = tmp_path / "images"
    images.mkdir()
    (images / "base.qcow2").write_bytes(b"QFI\xfb" + b"\0" * 60)
    monkeypatch.setenv("RACKPLANE_VM_IMAGE_DIRS", str(images))
    client = FakeClient()
    a = agent(tmp_path / "state", client, runtimes=["process", "vm"], work_dir=tmp_path / "work")
    host = probe_host(shutil.which("qemu-system-x86_64"))
    outside = assignment(VM, [], runtime="vm", image="/etc/passwd")
    others = [
        assignment(
            f"00000000-0000-4000-8000-0000000000c{i}", [], runtime="vm", image="base.qcow2", **kw
        )
        for i, kw in enumerate([{"confidential": "sev-snp"}, {"devices": [GPU0]}])
    ]
    a.set_assignments(assignments(outside, *others))
    a.step()
    assert "not in this node's image directories" in client.last(VM).message
    snp, gpu = (client.last(o.workload_id) for o in others)
    assert snp.state == gpu.state == "failed_to_start"
    if not host.sev_snp:
        assert "offers neither of SEV-SNP and TDX" in snp.message
    assert "no PCI bus id" in gpu.message  # this inventory has none (the runner's map: see vm.py)
    a.close()


# --- a real boot ---------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def guest():
    try:
        return vmguest.build()
    except vmguest.Unavailable as exc:
        pytest.skip(f"the test guest cannot be built: {exc}")


@pytest.fixture
def short_dirs():
    """A state and a work directory under /tmp with short paths (a Unix socket's path holds at
    most 107 bytes; pytest's tmp_path is longer), whatever runs there killed afterwards."""
    top = open_dir("rp-vm-")
    work = open_dir("rp-vmw-")
    yield top / "state", work
    for run_json in (top / "state").rglob("run.json"):
        pid = json.loads(run_json.read_text()).get("pid")
        try:
            if pid:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    shutil.rmtree(top, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


def _keypair(path: Path) -> str | None:
    """A new ed25519 key pair (ssh-keygen); its public line, or None without OpenSSH."""
    if shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
        return None
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tenant", "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path.with_suffix(".pub").read_text().strip()


def _ssh(key: Path, port: int, expect_ok: bool = True) -> str | None:
    """`hostname; id -u; id -u -n` over SSH as root; its output, or None when refused."""
    argv = ["ssh", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes"]
    argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    argv += ["-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "root@127.0.0.1"]
    argv += ["hostname; id -u; id -u -n"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        if expect_ok:
            time.sleep(0.5)
        return None
    return done.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid per run (QEMU's -runas) needs root")
def test_a_vm_boots_from_its_overlay_and_powers_down_through_qmp(guest, short_dirs, monkeypatch):
    state_dir, work_dir = short_dirs
    monkeypatch.setenv("RACKPLANE_VM_IMAGE_DIRS", str(guest.image.parent))
    base_before = _sha256(guest.image)
    client = FakeClient()
    a = agent(
        state_dir,
        client,
        runtimes=["process", "vm"],
        work_dir=work_dir,
        run_uids=(2_100_400, 2_100_499),
        ssh_ports=SSH_PORTS,
    )
    key = _keypair(work_dir / "tenant-key")
    vm = _vm(
        image=str(guest.image),
        hostname="tenant-box",
        ssh_keys=[key] if key else [KEY],
        memory_mib=256,
        cpu_milli=1000,
        grace_s=30.0,
    )
    began = time.monotonic()
    a.set_assignments(assignments(vm))
    step_until(a, lambda: (r := client.last(VM)) and r.state == "running", timeout=10)
    rec = a.runs[f"{VM}.0.0"]
    # The agent picked the node's port for the guest's SSH server, from its range.
    port = client.last(VM).ssh_port
    assert port is not None and SSH_PORTS[0] <= port <= SSH_PORTS[1] and rec.ssh_port == port
    assert not client.last(VM).ssh_ready

    def output() -> str:
        a.ship_logs()
        return client.output(VM)

    try:
        step_until(a, lambda: vmguest.UP_MARKER in output(), timeout=45, interval=0.2)
    except AssertionError:
        raise AssertionError(f"no {vmguest.UP_MARKER} in the console: {output()[-3000:]}") from None
    booted_s = time.monotonic() - began
    line = next(ln for ln in output().splitlines() if vmguest.UP_MARKER in ln)
    assert "hostname=tenant-box keys=1" in line, output()
    # QEMU runs as the run's own uid (it dropped to it with -runas) and got no workload env.
    shim = psutil.Process(rec.pid)
    qemu = next(p for p in shim.children() if p.name().startswith("qemu-system"))
    assert rec.uid is not None and qemu.uids().real == rec.uid and qemu.uids().effective == rec.uid
    assert "RACKPLANE_WORKLOAD_ID" not in qemu.environ()
    assert f"user,id=net0,restrict=on,hostfwd=tcp::{port}-:22" in qemu.cmdline()
    # Its disk is the run's overlay: the guest wrote into it; the base is as it was.
    overlay = Path(rec.workdir) / "disk.qcow2"
    assert vmguest.DISK_MARKER in overlay.read_bytes()
    assert overlay.stat().st_uid == rec.uid
    assert vmguest.DISK_MARKER not in guest.image.read_bytes()
    assert (rec.run_dir / "qmp.sock").is_socket()  # in the agent's state, not the tenant's dir
    ssh_s = None
    if vmguest.has_ssh_server():  # the guest's dropbear greets: the agent says so
        ssh_began = time.monotonic()
        step_until(a, lambda: (r := client.last(VM)) and r.ssh_ready, timeout=30, interval=0.2)
        ssh_s = time.monotonic() - ssh_began
        assert client.last(VM).ssh_port == port
    if key and ssh_s is not None:  # the tenant logs in with the key from the seed, no other
        got = wait_until(lambda: _ssh(work_dir / "tenant-key", port), timeout=30, interval=0.5)
        assert got.split() == ["tenant-box", "0", "root"], got
        other = _keypair(work_dir / "other-key")
        assert _ssh(work_dir / "other-key", port, expect_ok=False) is None and other

    # No longer assigned: the guest is powered down through QMP, within the grace.
    stop_began = time.monotonic()
    a.set_assignments(assignments(index=2))
    step_until(a, lambda: (r := client.last(VM)) and r.state == "exited", timeout=30)
    stopped_s = time.monotonic() - stop_began
    end = client.last(VM)
    assert (end.exit_code, end.signal, end.stopped) == (0, None, True), end
    assert rec.kill_sent_at is None and stopped_s < vm.grace_s
    assert vmguest.BUTTON_MARKER in output()
    assert _sha256(guest.image) == base_before
    assert not client.last(VM).ssh_ready and client.last(VM).ssh_port is None  # ended
    ssh = f", ssh ready {ssh_s:.1f}s after it" if ssh_s is not None else ", ssh not tried"
    print(f"\nvm: boot to marker {booted_s:.1f}s{ssh}, powerdown {stopped_s:.2f}s")
    a.close()
