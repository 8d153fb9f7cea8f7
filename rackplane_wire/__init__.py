"""The node agent's wire: what `rackplane agent` and the control plane say to each other.

This package is the only code the agent (`rackplane_agent`) and the server (`app`) share. It
imports pydantic and nothing else, so the agent stays a light program. Every message may be
repeated or lost: assignments are the node's whole desired state (level-triggered, never a
diff), and reports name the run they are about (workload, attempt, replica), so a report about
a run the control plane no longer holds is counted as stale and ignored.

Routes (all under `/v1/agent`, `Authorization: Bearer rpn_...` except `join`):

- `POST /join` (`JoinIn` -> `Joined`): a single-use join token for the node's credential.
- `PUT /inventory` (`Inventory` -> `InventoryVerdict`): what the host has; compared with the
  fleet's record of the node.
- `GET /assignments?index=N&wait=30s` (-> `Assignments`): a blocking query, as Nomad's. Answers
  at once when the node's desired state is newer than `index`, else when it changes, else after
  `wait` with the same index.
- `POST /status` (`StatusReport` -> `StatusAck`): the runs that changed, batched; also a
  heartbeat (send one at least every `Assignments.heartbeat_s`, even empty).
- `POST /logs` (`LogBatch` -> `LogAck`): output, batched, each chunk at its byte offset in the
  replica's output, so a repeated chunk is stored once.
- `GET /runs/{workload_id}/{attempt}/{replica}/env` (-> `RunEnv`; 409 `run_refused`: it cannot
  start, the workload's own doing, said in the problem's detail): the run's secret part of its
  environment (the workload's own `env` and its `RACKPLANE_TOKEN`), fetched when the agent starts
  that run; answered only while the node holds that run and it has not started.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

WIRE_VERSION = 1

# Every text field states what it may hold (and never a NUL character).
FREE = r"^[^\x00]*$"
DEVICE = r"^[A-Za-z0-9][A-Za-z0-9_./:-]*$"  # GPU-<uuid>, MIG-<uuid>, MIG-GPU-<uuid>/1/0
HOST = r"^[A-Za-z0-9._:%\[\]-]+$"  # a name, an IPv4 or [IPv6] address
TOKEN = r"^[A-Za-z0-9._+()-][A-Za-z0-9 ._+()-]*$"  # models, profiles, versions
# A workload id as the control plane gave it (a UUID; anything else is a stale report).
WORKLOAD = r"^[A-Za-z0-9-]{1,64}$"
SIGNAL = r"^SIG[A-Z0-9]{1,12}$"
MAX_INT = 2**53 - 1  # what JSON carries exactly

# `process` (argv on the host), `podman` (a container), `vm` (a QEMU/KVM virtual machine booted
# from the workload's disk image; `Assignment.confidential` makes it a confidential VM).
RuntimeName = Literal["process", "podman", "vm"]
# An OpenSSH public key line: its type, its base64 blob, an optional comment (never a private
# key, never more than one line).
SSH_PUBLIC_KEY = (
    r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com|"
    r"sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,2}( [^\x00-\x1f\x7f]*)?$"
)
# A host name (RFC 1123): dot-separated labels of letters, digits and inner hyphens.
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = rf"^{_HOST_LABEL}(\.{_HOST_LABEL})*$"
# The confidential-computing technologies a `vm` run may ask for.
Confidential = Literal["sev-snp", "tdx"]
# What the control plane wants of a run: started and kept running, or stopped (SIGTERM to its
# process group, then SIGKILL at `stop_deadline`).
Desired = Literal["run", "stop"]
# What a run is, as the agent sees it:
# - `running`: its process is up (`pid`, `at` = when it started);
# - `exited`: its process ended (`exit_code`, or `signal` when a signal killed it; `at` = when);
# - `failed_to_start`: it never ran (`message` says why: the image, the command, a GPU that is
#   not on this host);
# - `lost`: the agent knew the process and can no longer find it or its exit (after a host
#   reboot, say); counted as a failure of the run.
RunState = Literal["running", "exited", "failed_to_start", "lost"]


def _has_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


class _Wire(BaseModel):
    # Unknown fields are ignored, both ways: a newer server or agent may add some.
    model_config = ConfigDict(extra="ignore", frozen=True)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: object) -> object:
        # No text holds a NUL character: no name, path or output line needs one, and
        # PostgreSQL cannot store one.
        if _has_nul(value):
            raise ValueError("text may not contain the NUL character (U+0000)")
        return value


class MigInstance(_Wire):
    uuid: str = Field(
        max_length=80, pattern=DEVICE, description="`MIG-...`: what CUDA_VISIBLE_DEVICES names"
    )
    profile: str = Field(max_length=16, pattern=TOKEN, description="e.g. `1g.10gb`")
    start: int | None = Field(None, ge=0, le=7, description="First memory slice it occupies")


# What an agent can do beyond running work: `mig-layout` (it applies MIG layouts); `run-uids`
# (each `process` run has a uid of its own: without it, runs share the agent's user and the
# node is no wall between tenants); `sev-snp`, `tdx` (its `vm` runtime can launch confidential
# VMs with that technology: the host's kernel and QEMU both offer it); `ssh` (its `podman`
# runtime can make a run an instance one logs into: it has an SSH server to bring, and ports).
Capability = Literal["mig-layout", "run-uids", "sev-snp", "tdx", "ssh", "volumes", "shared-volumes"]


class MigSlot(_Wire):
    """One MIG instance a layout asks for: its profile (the model's name, e.g. `3g.40gb`) and
    the first memory slice it should occupy (a preference: the driver places what
    `nvidia-smi mig -cgi` creates; the agent reports where instances really are)."""

    profile: str = Field(max_length=16, pattern=TOKEN)
    start: int = Field(ge=0, le=7)


class MigLayout(_Wire):
    """The layout GPU `gpu` should have: MIG off (a whole GPU, `instances` empty) or on, with
    these GPU instances, each with one compute instance filling it. Applied only while nothing
    runs on that GPU; level-triggered (a GPU already so laid out is left alone)."""

    id: str = Field(pattern=WORKLOAD, max_length=64)
    gpu: int = Field(ge=0, le=255)
    mig_mode: bool
    instances: list[MigSlot] = Field(default_factory=list, max_length=7)


MigLayoutStatus = Literal["applied", "refused", "failed"]


class MigLayoutReport(_Wire):
    """What came of a layout: `applied` (what the GPU now has is in `instances`), `refused`
    (not tried: the GPU was busy, or the layout does not fit the model's geometry) or `failed`
    (a command failed: `detail` has its words; `instances` what the GPU has now)."""

    id: str = Field(pattern=WORKLOAD, max_length=64)
    gpu: int = Field(ge=0, le=255)
    status: MigLayoutStatus
    detail: str = Field("", max_length=500, pattern=FREE)
    mig_mode: bool = False
    instances: list[MigInstance] = Field(default_factory=list, max_length=7)


class GpuInfo(_Wire):
    index: int = Field(ge=0, le=255, description="The host's index (NVML's, nvidia-smi's)")
    uuid: str = Field(max_length=80, pattern=DEVICE, description="`GPU-...`")
    model: str = Field(
        max_length=64, pattern=TOKEN, description="The fleet's model name, e.g. `H100-80GB`"
    )
    memory_mib: int = Field(0, ge=0, le=10**8)
    pci_bus_id: str | None = Field(None, max_length=32, pattern=DEVICE)
    mig_mode: bool = False
    mig_instances: list[MigInstance] = Field(default_factory=list, max_length=7)
    # GB200 NVL72: the NVLink fabric's clique (cluster UUID + clique id), if NVML reports one.
    nvlink_clique: str | None = Field(None, max_length=80, pattern=DEVICE)


class Inventory(_Wire):
    hostname: str = Field(max_length=253, pattern=HOST)
    # How other hosts reach this one (a gang's MASTER_ADDR when its rank 0 runs here).
    address: str = Field(max_length=253, pattern=HOST)
    source: Literal["nvml", "file"]
    gpus: list[GpuInfo] = Field(max_length=256)
    driver_version: str | None = Field(None, max_length=32, pattern=TOKEN)
    cuda_version: str | None = Field(None, max_length=16, pattern=TOKEN)
    # The rest of the node's software stack, where the host knows it (compared with the stack
    # the node should run: a difference is drift).
    nccl_version: str | None = Field(None, max_length=32, pattern=TOKEN)
    firmware_version: str | None = Field(None, max_length=64, pattern=TOKEN)  # VBIOS
    fabric_manager_version: str | None = Field(None, max_length=32, pattern=TOKEN)
    os_image: str | None = Field(None, max_length=64, pattern=TOKEN)
    runtimes: list[RuntimeName] = Field(default_factory=lambda: ["process"])
    agent_version: str = Field(max_length=32, pattern=TOKEN)
    # What this agent can do beyond running work: `mig-layout` (it applies `mig_layouts`).
    # An older agent says nothing, and the control plane never asks it to.
    capabilities: list[Capability] = Field(default_factory=list, max_length=8)


class InventoryVerdict(_Wire):
    node: str
    matches: bool
    # Each difference between what the host has and what the fleet records, in words, e.g.
    # "GPU 3 missing", "GPU 1 is A100-80GB, the fleet records H100-80GB".
    differences: list[str]
    node_state: str = Field(description="The node's state after this inventory")


class VolumeMount(_Wire):
    """One of the tenant's volumes, mounted into the run: its directory on this node's volume
    storage (`node`) or on the shared storage it mounts (`shared`), named by the volume's id
    under the run's tenant."""

    id: str = Field(pattern=WORKLOAD, max_length=64)
    name: str = Field(max_length=63, pattern=TOKEN)
    storage: Literal["node", "shared"]
    # `process`: relative to the run's own directory; `podman`: absolute in the container.
    mount_path: str = Field(max_length=255, pattern=r"^[A-Za-z0-9._/@+-]+$")
    read_only: bool = False


class Serve(_Wire):
    """A run that serves HTTP (a replica of an inference endpoint): the port it listens on and
    the path that answers 2xx once it takes requests. The agent publishes it on a port of the
    node it picks from `--serve-ports` (`Assignment.serve_port`): a `process` run listens on
    that port itself (its `PORT`), a container on `port` (its `PORT` too) forwarded from it."""

    port: int = Field(ge=1, le=65_535)
    ready_path: str = Field(max_length=200, pattern=r"^/[A-Za-z0-9._~/?=&%+-]*$")


class Assignment(_Wire):
    """One replica of one workload that the control plane wants on this node."""

    workload_id: str
    # The workload's run number: it goes up each time the workload is placed again (after a
    # preemption or a fault). (workload_id, attempt, replica) names one run, everywhere.
    attempt: int = Field(ge=0)
    replica: int = Field(ge=0)
    desired: Desired
    runtime: RuntimeName = "process"
    command: list[str] = Field(description="argv; for `podman`, the container's command")
    image: str | None = None
    # Where the command starts: for `process`, relative to the run's own directory (the agent
    # makes it, the run's); for `podman`, an absolute path in the container. None: the run's
    # own directory, or the image's.
    workdir: str | None = Field(None, max_length=255, pattern=r"^[A-Za-z0-9._/@+-]+$")
    volumes: list[VolumeMount] = Field(default_factory=list, max_length=8)
    # The environment the control plane gives the run, but for its secrets: CUDA_VISIBLE_DEVICES,
    # NVIDIA_VISIBLE_DEVICES, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
    # RACKPLANE_WORKLOAD_ID, RACKPLANE_REPLICA, RACKPLANE_API and, when it resumes,
    # RACKPLANE_RESUME_FROM. The agent adds PATH-like basics and the run's HOME and TMPDIR.
    env: dict[str, str]
    # True: the workload's own env and RACKPLANE_TOKEN are fetched (`GET /runs/.../env`) when the
    # run starts, so the node's whole desired state never carries a tenant's secrets.
    fetch_env: bool = False
    # The tenant's group on every node: a run with a uid of its own gets this gid and umask 007,
    # so its files are shared with the tenant's other runs (a checkpoint the next attempt reads
    # on a shared disk) and with no other tenant. None: a gid of the run's own.
    run_gid: int | None = Field(None, ge=1000, le=2**31 - 1)
    # The tenant the run belongs to (an opaque id): runs of one tenant may share a network on
    # the node (a container's per-tenant network), never with another tenant's.
    tenant: str | None = Field(None, pattern=WORKLOAD, max_length=64)
    # The GPUs (or MIG instances) the run may use, by UUID: the agent refuses a run whose
    # devices are not on this host (`failed_to_start`), and podman gets them as CDI devices.
    devices: list[str]
    # Set when `desired` is `stop`: SIGTERM now, SIGKILL at this instant (server clock; the
    # agent uses `grace_s` from when it first saw the stop, whichever is sooner).
    stop_deadline: datetime | None = None
    grace_s: float = Field(30.0, ge=0)
    checkpoint_signal: str = "SIGUSR1"
    # Goes up each time the control plane asks for a checkpoint: send `checkpoint_signal` to the
    # run's process group once per increase.
    checkpoint_requests: int = Field(0, ge=0)
    # Memory and CPU the run was allocated (cgroup v2 limits where the host allows them).
    cpu_milli: int = Field(0, ge=0)
    memory_mib: int = Field(0, ge=0)
    # --- instances customers log into (`podman` and `vm` runs) ---
    ssh_keys: list[Annotated[str, Field(max_length=16_384, pattern=SSH_PUBLIC_KEY)]] = Field(
        default_factory=list,
        max_length=32,
        description="The tenant's SSH public keys (OpenSSH lines). Given: the run is an "
        "instance one logs into as `root` on a port of the node the agent picks from its "
        "`--ssh-ports` range (reported as `RunReport.ssh_port`): a `vm` gets the keys through "
        "its cloud-init NoCloud seed, a `podman` container an SSH server the agent brings",
    )
    hostname: str | None = Field(
        None,
        max_length=63,
        pattern=HOSTNAME,
        description="The VM's host name (cloud-init `local-hostname`); None: `rp-<workload id>`",
    )
    ssh_port: int | None = Field(
        None,
        ge=1,
        le=65_535,
        description="Set by the agent, never by the control plane: the node's TCP port it "
        "forwards to the run's SSH port (22), chosen when the run starts",
    )
    serve: Serve | None = None
    serve_port: int | None = Field(
        None,
        ge=1,
        le=65_535,
        description="Set by the agent, never by the control plane: the node's TCP port a "
        "serving run is reached on, chosen when the run starts",
    )
    confidential: Confidential | None = Field(
        None,
        description="Launch the VM as a confidential guest with this technology (the "
        "`confidential-vm` tier); refused by a host whose agent does not advertise it",
    )


class BurnInStep(_Wire):
    """One step of a node's validation suite: an argv the agent runs on the host, with a time
    limit. It passes when it exits 0, its output names no failing GPU, and (when the step has
    a bound) the bus bandwidth it printed is at least the bound. Output lines the agent reads:
    `RACKPLANE-BURNIN status=pass|fail [gpu=N] [busbw_gbps=X] [detail=...]` (for any command),
    nccl-tests' `# Avg bus bandwidth : X` and dcgmi diag's result table (`Fail - GPU: N`)."""

    name: str = Field(max_length=63, pattern=TOKEN)
    command: list[Annotated[str, Field(max_length=4096, pattern=FREE)]] = Field(
        min_length=1, max_length=128
    )
    timeout_s: float = Field(gt=0, le=86_400)
    min_busbw_gbps: float | None = Field(None, gt=0, le=100_000)
    # A check of a tool the host may not have (dcgmi where DCGM is not installed): skipped,
    # not failed, when its command is not there.
    optional: bool = False


class BurnIn(_Wire):
    """The suite the node must pass before it takes work (bring-up, after a repair, after an
    upgrade). Run only while the node runs nothing else; steps in order, stopping at the first
    that fails."""

    id: str = Field(pattern=WORKLOAD, max_length=64)
    steps: list[BurnInStep] = Field(min_length=1, max_length=32)
    # The steps change the host's software (an upgrade installs a stack): when they are over,
    # read the inventory again and send it with the report (`StatusReport.inventory`).
    reinventory: bool = False


class Assignments(_Wire):
    node: str
    # The node's desired-state index: send it back as `?index=` to wait for the next change.
    index: int = Field(ge=0)
    assignments: list[Assignment]
    # Report (POST /status) at least this often, even with nothing to say: a node silent for
    # the heartbeat timeout is lost, and its work is moved.
    heartbeat_s: float = Field(gt=0)
    # A validation suite to run now, if any (the node is out of service until it passes).
    burn_in: BurnIn | None = None
    # MIG layouts to apply, at most one per GPU, each only while its GPU is idle.
    mig_layouts: list[MigLayout] = Field(default_factory=list, max_length=256)


class RunReport(_Wire):
    workload_id: str = Field(pattern=WORKLOAD, max_length=64)
    attempt: int = Field(ge=0, le=2**31 - 1)
    replica: int = Field(ge=0, le=100_000)
    state: RunState
    at: datetime = Field(description="When the state began (the agent's clock, with offset)")
    pid: int | None = Field(None, ge=1, le=2**31 - 1)
    exit_code: int | None = Field(None, ge=-255, le=255)
    signal: str | None = Field(
        None, max_length=16, pattern=SIGNAL, description="e.g. SIGKILL, if one killed it"
    )
    # True when the run ended because the control plane asked it to stop (desired `stop`):
    # such an exit is a stop, not a failure, whatever its code.
    stopped: bool = False
    message: str | None = Field(None, max_length=2000, pattern=FREE)
    # With `failed_to_start`: "workload" when the workload itself cannot start (no such command,
    # not executable): it fails at once, as it would on any node. None: the node's fault, and the
    # workload is placed again. With `lost`: "agent" when the run's process ended but the agent
    # failed to record how (its exit record could not be written or read): the agent's
    # failure, never the workload's or its hardware's. None: it vanished with its host.
    fault: Literal["workload", "agent"] | None = None
    # An instance's SSH endpoint: the node's port forwarded to its SSH server (22), and
    # whether an SSH server answered there (its `SSH-2.0-...` banner) since the run started.
    ssh_port: int | None = Field(None, ge=1, le=65_535)
    ssh_ready: bool = False
    # A serving run's endpoint: the node's port it is reached on, and whether a GET of its
    # readiness path has answered 2xx there since it started.
    serve_port: int | None = Field(None, ge=1, le=65_535)
    serve_ready: bool = False
    # The last lines of output, with an exit (at most 20, each cut to 500 characters).
    tail: list[Annotated[str, Field(max_length=2000, pattern=FREE)]] = Field(
        default_factory=list, max_length=20
    )


BurnInStatus = Literal["passed", "failed", "timed_out", "skipped"]


class BurnInStepResult(_Wire):
    name: str = Field(max_length=63, pattern=TOKEN)
    status: BurnInStatus
    gpu: int | None = Field(None, ge=0, le=255, description="The GPU that failed, if one did")
    busbw_gbps: float | None = Field(None, ge=0, le=100_000)
    detail: str = Field("", max_length=500, pattern=FREE)
    seconds: float = Field(ge=0, le=10**6)


class BurnInReport(_Wire):
    """What the agent has of a burn-in: each step finished so far, and whether it is over (every
    step passed, or one failed)."""

    id: str = Field(pattern=WORKLOAD, max_length=64)
    results: list[BurnInStepResult] = Field(default_factory=list, max_length=32)
    done: bool = False


class StatusReport(_Wire):
    runs: list[RunReport] = Field(default_factory=list, max_length=2000)
    burn_in: BurnInReport | None = None
    # The host's inventory read again, sent with a finished burn-in that asked for it
    # (`BurnIn.reinventory`): taken before the burn-in is judged.
    inventory: Inventory | None = None
    # What came of each MIG layout asked for, until acknowledged.
    mig_layouts: list[MigLayoutReport] = Field(default_factory=list, max_length=256)


class StatusAck(_Wire):
    accepted: int
    stale: int = Field(description="Reports about runs the control plane no longer holds")


class RunEnv(_Wire):
    """The secret part of one run's environment (added over `Assignment.env`): the workload's
    own `env`, the values of the tenant secrets it names (`secret_env`) and its run token."""

    env: dict[str, str]


class LogChunk(_Wire):
    workload_id: str = Field(pattern=WORKLOAD, max_length=64)
    attempt: int = Field(ge=0, le=2**31 - 1)
    replica: int = Field(ge=0, le=100_000)
    offset: int = Field(ge=0, le=MAX_INT, description="Byte offset of `data` in the run's output")
    data: str = Field(
        max_length=256 * 1024,
        pattern=FREE,
        description="UTF-8 text (undecodable bytes as U+FFFD; NUL bytes as U+FFFD too)",
    )
    at: datetime


class LogBatch(_Wire):
    chunks: list[LogChunk] = Field(max_length=500)


class LogAck(_Wire):
    accepted: int
    stale: int
