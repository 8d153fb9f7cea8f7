from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, Field, field_validator, model_validator

from app.core.schemas import (
    MAX_JSON_INT,
    RESOURCE_NAME_PATTERN,
    StrictModel,
    strict_schema,
)
from app.models.workloads import WorkloadShape
from app.placement.catalog import GPU_MODELS
from app.placement.mig import PROFILES, profile_by_name, profile_names
from app.workloads.tiers import ISOLATION_CHOICES

Priority = Literal["production", "training", "research", "preemptible"]
Isolation = Literal[tuple(ISOLATION_CHOICES)]  # type: ignore[valid-type]
GpuModelName = Literal[tuple(GPU_MODELS)]  # type: ignore[valid-type]
# Generic keys first, then each model's names (a name may belong to several models).
_MODEL_NAMES = profile_names()
MigProfileName = Literal[tuple([*PROFILES, *sorted(_MODEL_NAMES)])]  # type: ignore[valid-type]
_OTHER_ISOLATION = [c for c in ISOLATION_CHOICES if c != "confidential-vm"]


def _workload_rules(schema: dict[str, Any], _model: type) -> None:
    """The cross-field rules `WorkloadCreate._shape` enforces, stated in its JSON Schema so
    clients and fuzzers see them: exactly one shape (whole GPUs, a MIG profile, or a share
    with its memory); replicas and topology only for jobs; a VM on 1, 2, 4 or 8 whole GPUs;
    a model's MIG profile name only with one of its family's models (or no model list)."""
    strict_schema(schema, _model)
    schema["allOf"] = [_one_shape(), _what_each_kind_may_be(), {"anyOf": _mig_names()}]


_ZERO, _NULL = {"const": 0}, {"type": "null"}


def _one_shape() -> dict[str, Any]:
    """Exactly one shape: whole GPUs, a MIG profile, or a share with its memory."""
    zero, null = _ZERO, _NULL
    return {
        "oneOf": [
            {
                "required": ["gpus"],
                "properties": {
                    "gpus": {"minimum": 1},
                    "mig_profile": null,
                    "milli": zero,
                    "gpu_memory_mib": zero,
                },
            },
            {
                "required": ["mig_profile"],
                "properties": {
                    "mig_profile": {"enum": list(MigProfileName.__args__)},
                    "gpus": zero,
                    "milli": zero,
                    "gpu_memory_mib": zero,
                },
            },
            {
                "required": ["milli", "gpu_memory_mib"],
                "properties": {
                    "milli": {"minimum": 1},
                    "gpu_memory_mib": {"minimum": 1},
                    "gpus": zero,
                    "mig_profile": null,
                },
            },
        ]
    }


def _what_each_kind_may_be() -> dict[str, Any]:
    """What a job, an instance (SSH keys only in a container) and a VM may each be."""
    null = _NULL
    not_confidential = {"enum": [*_OTHER_ISOLATION, None]}
    on_host = {"enum": ["process", "podman", None]}
    no_keys = {"maxItems": 0}
    return (
        # Conditions as few anyOf as state them (generators expand their product; if/then/else
        # few read): what each kind may be, and which models a MIG profile's name belongs to.
        {
            "anyOf": [
                {
                    "properties": {
                        "kind": {"const": "job"},
                        "isolation": not_confidential,
                        "runtime": on_host,
                        "ssh_keys": no_keys,
                    }
                },
                {  # an instance: SSH keys only in a container
                    "properties": {
                        "kind": {"const": "instance"},
                        "isolation": not_confidential,
                        "replicas": {"const": 1},
                        "topology": null,
                        "runtime": on_host,
                        "ssh_keys": no_keys,
                    }
                },
                {
                    "required": ["runtime"],
                    "properties": {
                        "kind": {"const": "instance"},
                        "isolation": not_confidential,
                        "replicas": {"const": 1},
                        "topology": null,
                        "runtime": {"const": "podman"},
                    },
                },
                {  # a VM: 1, 2, 4 or 8 whole GPUs, one replica
                    "required": ["gpus"],
                    "properties": {
                        "kind": {"const": "vm"},
                        "gpus": {"enum": [1, 2, 4, 8]},
                        "replicas": {"const": 1},
                        "topology": null,
                        "runtime": {"enum": ["vm", None]},
                    },
                },
            ]
        }
    )


def _mig_names() -> list[dict[str, Any]]:
    """A MIG profile's generic key anywhere; a model's own name only with one of its models
    (or no model list)."""
    # Names grouped by family: groups that share a model are one (B200's and GB200's), since
    # each branch multiplies what a generator expands (schemathesis gave up on the 30th
    # property with a branch per model set); the API still refuses a name of the family's
    # other model (422).
    by_models: dict[frozenset[str], list[str]] = {}
    for name, models in _MODEL_NAMES.items():
        names = [name]
        for seen in [m for m in by_models if m & models]:
            models, names = models | seen, names + by_models.pop(seen)
        by_models[models] = names
    mig: list[dict[str, Any]] = [{"properties": {"mig_profile": {"enum": [*PROFILES, None]}}}]
    for models, names in sorted(by_models.items(), key=lambda kv: sorted(kv[1])):
        mig.append(  # a model's own name: no model list, or one of its models in it
            {
                "required": ["mig_profile"],
                "properties": {
                    "mig_profile": {"enum": sorted(names)},
                    "gpu_models": {
                        "anyOf": [{"maxItems": 0}, {"contains": {"enum": sorted(models)}}]
                    },
                },
            }
        )
    return mig


class TopologyIn(StrictModel):
    level: Literal["nvlink_domain", "rack", "block"]
    mode: Literal["required", "preferred"] = "preferred"


class CheckpointPolicy(StrictModel):
    interval_s: int | None = Field(
        None, ge=60, le=7 * 86400, description="The workload checkpoints this often."
    )
    cost_s: int = Field(0, ge=0, le=3600, description="Seconds it takes to write a checkpoint.")
    signal: Literal["SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT", "SIGTERM"] = Field(
        "SIGUSR1",
        description="The signal a node agent sends its processes to ask for a checkpoint now "
        "(they keep running). A stop is always SIGTERM, then SIGKILL after the grace.",
    )


RestartCause = Literal["failure", "infrastructure", "preemption"]


class RestartPolicy(StrictModel):
    """What restarts a workload, and how often, before it fails (as Kubernetes' `backoffLimit`
    with a pod failure policy, SkyPilot's `max_restarts_on_errors`, Slurm's requeue limit).
    Causes: `failure` (its own process exited non-zero or crashed), `infrastructure` (a hardware
    fault, its node went down or its agent lost the run, a start that failed on the node) and
    `preemption` (higher-priority work took its GPUs, its node was drained, or it was moved
    off a suspect GPU). The default never loops without bound: a failure ends it, and the
    eleventh infrastructure restart fails it; preemptions restart it without counting."""

    on: list[RestartCause] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["infrastructure", "preemption"],
        max_length=3,
        description="The causes after which it restarts (from its last checkpoint); after any "
        "other it fails. Add `failure` to restart it after its own non-zero exit.",
    )
    max_restarts: int = Field(
        10,
        ge=0,
        le=1000,
        description="Restarts it may have for the causes in `counts`; the next such cause "
        "fails it (`restart_limit_reached`).",
    )
    counts: list[RestartCause] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["failure", "infrastructure"],
        max_length=3,
        description="The causes whose restarts count against `max_restarts`; every cause in "
        "`on` but `preemption` must be here, so that nothing restarts without a limit.",
    )
    backoff_s: int = Field(
        10,
        ge=0,
        le=3600,
        description="A counted restart after the first waits this long before it may be "
        "placed, doubling each time up to `backoff_max_s` (the first is at once).",
    )
    backoff_max_s: int = Field(300, ge=0, le=86400)

    @field_validator("on", "counts")
    @classmethod
    def _distinct(cls, causes: list[str]) -> list[str]:
        if len(set(causes)) != len(causes):
            raise ValueError("names a cause twice")
        return causes

    @model_validator(mode="after")
    def _backoff(self) -> RestartPolicy:
        if self.backoff_max_s < self.backoff_s:
            raise ValueError("backoff_max_s is less than backoff_s")
        # Only preemptions may restart without counting (the scheduler bounds them): a failure
        # or a fault that restarts uncounted could loop without end.
        loose = [c for c in self.on if c != "preemption" and c not in self.counts]
        if loose:
            raise ValueError(
                f"restarts after {' and '.join(loose)} must count against max_restarts "
                "(add them to counts): only preemptions may restart without a limit"
            )
        return self


MAX_ARRAY = 1000
MAX_DEPENDENCIES = 64


class ArrayIn(StrictModel):
    """A job array (Slurm's `--array=0-N%M`): `count` jobs alike but for their index, which
    each one's processes get as `RACKPLANE_ARRAY_INDEX` (0 to count-1)."""

    count: int = Field(..., ge=1, le=MAX_ARRAY, description="How many elements")
    max_parallel: int | None = Field(
        None,
        ge=1,
        le=MAX_ARRAY,
        description="At most this many elements queued for placement or running at once; the "
        "rest wait (`ArrayLimit`) and start, lowest index first, as others end. Omitted: all.",
    )


class ElasticIn(StrictModel):
    """An elastic gang (TorchElastic's `--nnodes=MIN:MAX`): when a host is lost it goes on at
    once on the replicas left, as a new attempt with a smaller `WORLD_SIZE` from its last
    checkpoint, if at least `min_replicas` are; it grows back to `replicas` at a checkpoint
    once capacity returns. Its processes must resume at any world size."""

    min_replicas: int = Field(
        ..., ge=1, le=4096, description="The fewest replicas it may run on (below `replicas`)"
    )


VolumeStorage = Literal["node", "shared"]
MAX_VOLUMES = 8
# Where a container may not have a volume: the root, and what the runtime itself mounts.
CONTAINER_SYSTEM_PATHS = ("/proc", "/sys", "/dev", "/.rackplane", "/etc/hosts", "/etc/resolv.conf")


class VolumePut(StrictModel):
    """A volume: a named directory of yours that your runs mount (`volumes` on a workload)."""

    storage: VolumeStorage = Field(
        "node",
        description="`node`: a directory on the local disk of each node a run lands on (what a "
        "run writes stays on that node: scratch, caches, a dataset copied once per node); "
        "`shared`: a directory on the fleet's shared storage (every node that offers it sees "
        "the same files: checkpoints, results; work that mounts one is placed only on such "
        "nodes). Fixed once made.",
    )


class VolumeSet(VolumePut):
    """A volume's name and storage together (GraphQL's `putVolume`; REST names it in the
    path)."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=63,
        pattern=RESOURCE_NAME_PATTERN,
        description="Unique in your account: letters, digits, `.`, `_` and `-` (1 to 63).",
        examples=["datasets"],
    )


class VolumeMountIn(StrictModel):
    """One of your volumes, mounted into each of the workload's runs."""

    name: str = Field(
        ..., min_length=1, max_length=63, pattern=RESOURCE_NAME_PATTERN, description="Its name"
    )
    mount_path: str = Field(
        ...,
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9._/@+-]+$",
        description="Where the run sees it. `process`: a path relative to the run's own "
        "directory (`data`); `podman`: an absolute path in the container (`/data`).",
    )
    read_only: bool = Field(
        False, description="Mounted read-only (containers only: a process run's are writable)"
    )


# A working directory: path characters only (no space, quote or control character).
WORKDIR_PATTERN = r"^[A-Za-z0-9._/@+-]+$"
# What a workload's process is given: names as POSIX shells allow, none of the agent's own.
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
ENV_RESERVED_PREFIX = "RACKPLANE_"
# Set by the node agent for each replica: a workload cannot override them either.
ENV_RESERVED = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
    }
)
MAX_ENV_BYTES = 32 * 1024
MAX_COMMAND_BYTES = 64 * 1024


class WorkloadCreate(StrictModel):
    model_config = {**StrictModel.model_config, "json_schema_extra": _workload_rules}

    kind: Literal["instance", "vm", "job"] = Field(
        ...,
        description="`instance`: a container on whole GPUs, a MIG slice or a fractional share; "
        "`vm`: passthrough or confidential VM; `job`: a gang of `replicas` all or nothing.",
    )
    name: str | None = Field(None, max_length=200)
    gpu_models: list[GpuModelName] = Field(  # type: ignore[valid-type]
        default_factory=list, max_length=8, description="Allowed GPU models; empty = any."
    )
    gpus: int = Field(0, ge=0, le=72, description="Whole GPUs per replica, on one node.")
    mig_profile: MigProfileName | None = Field(  # type: ignore[valid-type]
        None, description="A MIG profile: the model's name (`3g.40gb`) or the generic key (`3g`)."
    )
    milli: int = Field(0, ge=0, le=999, description="A fractional share of one GPU (milli-GPU).")
    gpu_memory_mib: int = Field(0, ge=0, le=200_000, description="GPU memory of the share.")
    cpu_milli: int = Field(0, ge=0, le=1_000_000)
    memory_mib: int = Field(0, ge=0, le=8_000_000)
    replicas: int = Field(1, ge=1, le=4096)
    isolation: Isolation | None = Field(  # type: ignore[valid-type]
        None, description="Requested isolation; omitted: chosen from the tenant's policy."
    )
    priority: Priority = "training"
    topology: TopologyIn | None = None
    region: str | None = Field(None, max_length=63)
    stack: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$",
        description="Run only on nodes that run this software stack (a name from the fleet's "
        "stacks); every replica of a gang runs on one stack whether asked or not.",
    )
    min_cuda: str | None = Field(
        None,
        max_length=5,
        pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$",
        description="Run only on nodes whose CUDA version is at least this, e.g. `12.4`.",
    )
    max_runtime_s: int = Field(
        86400,
        ge=60,
        le=30 * 86400,
        description="Each run is stopped (failed, `max_runtime_exceeded`) when it runs longer.",
    )
    run_for_s: int | None = Field(
        None,
        ge=1,
        le=30 * 86400,
        description="The process exits 0 after running this long: on a simulated node (demos, "
        "tests), and on an agent's node when no `command` is given (a `sleep`).",
    )
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    # No description beside the $ref (RestartPolicy's own says it): schemathesis cannot
    # generate bodies from a $ref with siblings inside the workload rules' allOf.
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    labels: dict[
        Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(max_length=256)]
    ] = Field(default_factory=dict, max_length=64)
    image: str | None = Field(
        None,
        max_length=500,
        pattern=r"^[a-z0-9][a-z0-9._/:@-]*$",
        description="Container (or VM disk) image: what the `podman` runtime runs, and the "
        "rendered manifest's (default: CUDA base).",
    )
    workdir: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=WORKDIR_PATTERN,
        description="Where the command starts. `process`: a path relative to the run's own "
        "directory (its HOME), made for it (`src/app`); `podman`: an absolute path in the "
        "container (`/workspace`), as `podman run --workdir`. Omitted: the run's own directory, "
        "or the image's working directory. Not for VMs.",
        examples=["src/app"],
    )
    command: list[Annotated[str, Field(max_length=16384)]] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="The argv each replica runs on its node (its agent starts it in its own "
        "process group, with its GPUs). Omitted: the replica holds its GPUs (an interactive "
        "instance), for `run_for_s` if given.",
    )
    env: dict[Annotated[str, Field(pattern=ENV_NAME)], Annotated[str, Field(max_length=16384)]] = (
        Field(
            default_factory=dict,
            max_length=256,
            description="Environment of each replica's process (32 KiB in all). Names the agent "
            "sets (`RACKPLANE_*`, `CUDA_VISIBLE_DEVICES`, `NVIDIA_VISIBLE_DEVICES`, `RANK`, "
            "`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, and torchrun's "
            "`LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, "
            "`TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_RUN_ID`) are refused.",
        )
    )
    secret_env: dict[
        Annotated[str, Field(pattern=ENV_NAME)],
        Annotated[str, Field(pattern=RESOURCE_NAME_PATTERN)],
    ] = Field(
        default_factory=dict,
        max_length=64,
        description="Environment variables whose values are your secrets (`/v1/secrets`), by "
        'name: `{"HF_TOKEN": "hf-token"}`. The value is read when each run starts (a '
        "secret replaced since gives its new value to the next run), and shows in no read, "
        "event or log of the workload. Put anything sensitive here, not in `env`, which reads "
        "show as given.",
    )
    runtime: Literal["process", "podman", "vm"] | None = Field(
        None,
        description="How a node agent runs it. `process`: the command as a process of its own "
        "uid on the host (only in pools the operator trusts with it); `podman`: a container of "
        "`image`, its GPUs passed as CDI devices; `vm`: a virtual machine booted from the disk "
        "image `image`, its GPUs passed through (`kind: vm` only). Omitted: `vm` for a VM, "
        "`process` otherwise.",
    )
    ssh_keys: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        default_factory=list,
        max_length=32,
        description="Names of your SSH keys (`/v1/ssh-keys`) that may log in as `root`: an "
        "instance (`podman` runtime) or a VM becomes one you SSH into; its `connect` says how "
        "once it runs. Keys are copied at launch: deleting one later does not reach into it.",
    )

    volumes: list[VolumeMountIn] = Field(
        default_factory=list,
        max_length=MAX_VOLUMES,
        description="Your volumes (`/v1/volumes`) each run mounts, by name. Not for VMs.",
    )
    depends_on: list[uuid.UUID] = Field(
        default_factory=list,
        max_length=MAX_DEPENDENCIES,
        description="Workloads (or job arrays, by their `array.id`: each element) of yours "
        "that must succeed before this one may be placed, as Slurm's `--dependency=afterok`. "
        "Until then it is queued, `pending.reason` `Dependency`; if one fails or is "
        "terminated, this one fails at once (`dependency_failed`). One already failed or "
        "terminated is refused (422 `dependency_failed`).",
    )
    array: ArrayIn | None = None
    elastic: ElasticIn | None = None

    @field_validator("depends_on")
    @classmethod
    def _depends_on(cls, ids: list[uuid.UUID]) -> list[uuid.UUID]:
        if len(set(ids)) != len(ids):
            raise ValueError("depends_on names a workload twice")
        return ids

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in env if k.startswith(ENV_RESERVED_PREFIX) or k in ENV_RESERVED)
        if reserved:
            raise ValueError(f"env may not set {', '.join(reserved)}: the node agent sets them")
        if sum(len(k) + len(v) + 2 for k, v in env.items()) > MAX_ENV_BYTES:
            raise ValueError(f"env is larger than {MAX_ENV_BYTES} bytes")
        return env

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, refs: dict[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in refs if k.startswith(ENV_RESERVED_PREFIX) or k in ENV_RESERVED)
        if reserved:
            raise ValueError(
                f"secret_env may not set {', '.join(reserved)}: the node agent sets them"
            )
        return refs

    @field_validator("command")
    @classmethod
    def _command(cls, command: list[str] | None) -> list[str] | None:
        if command is not None:
            if sum(len(a) + 1 for a in command) > MAX_COMMAND_BYTES:
                raise ValueError(f"command is larger than {MAX_COMMAND_BYTES} bytes")
            if not command[0]:
                raise ValueError("command's first element (the program) is empty")
        return command

    @model_validator(mode="after")
    def _runtime(self) -> WorkloadCreate:
        if self.runtime is None:
            self.runtime = "vm" if self.kind == "vm" else "process"
        if (self.kind == "vm") != (self.runtime == "vm"):
            raise ValueError("a VM (kind `vm`) runs in the `vm` runtime, and only a VM does")
        if len(set(self.ssh_keys)) != len(self.ssh_keys):
            raise ValueError("ssh_keys names a key twice")
        if self.ssh_keys and self.kind == "job":
            raise ValueError("ssh_keys is for instances and VMs, not jobs")
        if self.ssh_keys and self.runtime == "process":
            raise ValueError(
                "ssh_keys needs the podman runtime (an instance's container) or a VM: a "
                "process has no SSH server of its own"
            )
        if self.runtime == "podman" and not self.image:
            raise ValueError("the podman runtime needs an image")
        if self.workdir is not None:
            parts = self.workdir.strip("/").split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise ValueError("workdir has an empty, `.` or `..` part")
            if self.runtime == "vm":
                raise ValueError("workdir is for `process` and `podman` runs, not VMs")
            if self.runtime == "process" and self.workdir.startswith("/"):
                raise ValueError(
                    "a `process` run's workdir is relative to its own directory (no `/` first): "
                    "a run reaches nothing of the host's outside it"
                )
            if self.runtime == "podman" and not self.workdir.startswith("/"):
                raise ValueError("a `podman` run's workdir is an absolute path in the container")
        self._check_volumes()
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{', '.join(both)} is set by both env and secret_env")
        if self.runtime == "podman":
            # The node hands a container its env as `NAME=value` lines.
            broken = sorted(k for k, v in self.env.items() if "\n" in v or "\r" in v)
            if broken:
                raise ValueError(
                    f"env {', '.join(broken)} holds a line break, which the podman runtime "
                    "cannot pass to a container"
                )
        return self

    def _check_volumes(self) -> None:
        if not self.volumes:
            return
        if self.runtime == "vm":
            raise ValueError("volumes are for `process` and `podman` runs, not VMs")
        names = [v.name for v in self.volumes]
        if len(set(names)) != len(names):
            raise ValueError("volumes names a volume twice")
        paths = [v.mount_path.rstrip("/") for v in self.volumes]
        for v, path in zip(self.volumes, paths, strict=True):
            parts = path.strip("/").split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"volume {v.name}: mount_path has an empty, `.` or `..` part")
            if self.runtime == "process":
                if path.startswith("/"):
                    raise ValueError(
                        f"volume {v.name}: a `process` run's mount_path is relative to its "
                        "own directory (no `/` first)"
                    )
                if v.read_only:
                    raise ValueError(
                        f"volume {v.name}: read_only needs a container (the podman runtime); a "
                        "process run's volumes are writable"
                    )
            elif not path.startswith("/"):
                raise ValueError(
                    f"volume {v.name}: a `podman` run's mount_path is an absolute path"
                )
            elif any(path == p or path.startswith(p + "/") for p in CONTAINER_SYSTEM_PATHS):
                raise ValueError(f"volume {v.name}: {path} is the container runtime's own")
        for a in paths:
            for b in paths:
                if a != b and b.startswith(a + "/"):
                    raise ValueError(f"mount paths {a} and {b} nest")
        if len(set(paths)) != len(paths):
            raise ValueError("two volumes have one mount_path")

    @model_validator(mode="after")
    def _shape(self) -> WorkloadCreate:
        given = [
            n
            for n, v in (
                ("gpus", self.gpus),
                ("mig_profile", self.mig_profile),
                ("milli", self.milli),
            )
            if v
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of gpus, mig_profile or milli")
        if self.milli and not self.gpu_memory_mib:
            raise ValueError("a fractional share needs gpu_memory_mib")
        if not self.milli and self.gpu_memory_mib:
            raise ValueError("gpu_memory_mib is for fractional shares only")
        if self.mig_profile:
            models = self.gpu_models or [m for m in GPU_MODELS if GPU_MODELS[m].mig_capable]
            keys = set()
            for m in models:
                try:
                    keys.add(profile_by_name(m, self.mig_profile).key)
                except KeyError:
                    pass
            if not keys:
                raise ValueError(
                    f"{self.mig_profile!r} is not a MIG profile of {', '.join(models)}"
                )
            if len(keys) > 1:
                raise ValueError(f"{self.mig_profile!r} means different slices on these models")
            self.mig_profile = keys.pop()
        if self.kind != "job" and self.replicas != 1:
            raise ValueError("only a job has replicas")
        if self.elastic is not None and self.elastic.min_replicas >= self.replicas:
            raise ValueError("elastic.min_replicas must be below replicas (a gang of several)")
        if self.topology is not None and self.kind != "job":
            raise ValueError("a topology constraint applies to a job (a gang)")
        if self.array is not None:
            if self.kind != "job":
                raise ValueError("only a job can be an array")
            if self.array.max_parallel is not None and self.array.max_parallel > self.array.count:
                raise ValueError("array.max_parallel is more than array.count")
        return self

    @property
    def shape(self) -> WorkloadShape:
        """One replica's request, as the workload stores it and the scheduling edge reads it."""
        return WorkloadShape(
            gpus=self.gpus,
            mig_profile=self.mig_profile,
            milli=self.milli,
            gpu_memory_mib=self.gpu_memory_mib,
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            gpu_models=tuple(self.gpu_models),
        )

    @property
    def unit(self) -> str:
        return self.shape.unit

    @property
    def gpu_milli(self) -> int:
        per = (
            self.gpus * 1000
            if self.gpus
            else PROFILES[self.mig_profile].gpu_equivalent_milli
            if self.mig_profile
            else self.milli
        )
        return per * self.replicas


class ExitIn(StrictModel):
    """A node agent's report that a workload's process exited."""

    exit_code: int = Field(..., ge=-255, le=255, description="0: success; anything else: failure")
    at: AwareDatetime | None = Field(None, description="When it exited (default: now)")
    message: str | None = Field(None, max_length=500, description="e.g. the last log line")


class CheckpointIn(StrictModel):
    completed_at: AwareDatetime | None = Field(None, description="Default: now. With an offset.")
    size_bytes: int = Field(..., ge=0, le=MAX_JSON_INT)
    uri: str | None = Field(
        None,
        max_length=2000,
        pattern=r"^[a-z][a-z0-9+.-]*://\S+$",
        description="Where it is (`s3://...`, `file:///...`): the next run resumes from it "
        "(`RACKPLANE_RESUME_FROM`)",
    )
    step: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="The step it holds. Never below the resume point's step "
        "(`last_checkpoint_step`): such a report is refused, 409 `checkpoint_step_behind`, and "
        "the resume point stays.",
    )


class RankStep(StrictModel):
    rank: int = Field(ge=0, le=100_000, description="Global rank: replica x GPUs + local GPU")
    step_time_s: float = Field(gt=0, le=86_400, description="Mean step time over the window")


class ProgressIn(StrictModel):
    ranks: list[RankStep] = Field(
        min_length=1,
        max_length=100_000,
        description="A gang's ranks (compared with each other), or a shared GPU's one rank 0 "
        "(compared with its own best pace)",
    )


class QuotaIn(StrictModel):
    gpu_model: GpuModelName  # type: ignore[valid-type]
    # At most a million GPUs: the columns are 32-bit.
    guaranteed_milli: int = Field(
        0, ge=0, le=10**9, description="GPU-equivalents in milli (1 GPU = 1000)."
    )
    limit_milli: int | None = Field(None, ge=0, le=10**9, description="Hard limit; null: none.")
    weight: float = Field(1.0, gt=0, le=1000)

    @model_validator(mode="after")
    def _covers(self) -> QuotaIn:
        if self.limit_milli is not None and self.limit_milli < self.guaranteed_milli:
            raise ValueError("limit_milli must be at least guaranteed_milli")
        return self


class QuotaSet(StrictModel):
    quotas: list[QuotaIn] = Field(..., max_length=32)

    @model_validator(mode="after")
    def _unique(self) -> QuotaSet:
        models = [q.gpu_model for q in self.quotas]
        if len(models) != len(set(models)):
            raise ValueError("one entry per gpu_model")
        return self
