"""What each fault signal means and what the health loop does about it: one table.

Every Xid NVIDIA's catalog lists for A100, H100, B100/B200 or GB200 with an immediate action
other than IGNORE has a row, plus the few IGNORE codes that other sources ask us to watch, plus
the non-Xid signals (ECC and memory-repair counters, NVLink and PCIe error counters, clock
slowdown, the driver's own recovery verdict, a silent node agent). Each row cites its source:

- [CAT] NVIDIA, "Analyzing Xid Errors with the Xid Catalog",
  https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html : the column "Resolution
  Bucket (Immediate Action)" per code and GPU generation.
- [NVS] NVIDIA NVSentinel, distros/kubernetes/nvsentinel/charts/gpu-health-monitor/
  xiderrorsmapping.csv (Xid -> action, FATAL/NONFATAL) and dcgmerrorsmapping.csv (DCGM health
  failures -> action).
- [DCGM] NVIDIA DCGM, testing/TestHealthMonitor.cpp (which Xids the health watches fail or
  warn on) and dcgmlib/dcgm_fields.h (field ids, clock event reason bits).
- [NVML] nvmlDeviceGpuRecoveryAction_t (values of DCGM_FI_DEV_GPU_RECOVERY_ACTION, field 1523).
- [HV] NVIDIA Health Validation, reference/checks/xid (GB200/GB300 checks and their actions).
- [REF] ../shared/reference/health.md (our digest of the above and of published reports).

Our actions, mildest first (`Action.rank`): an incident is classified by its worst row.
- none: an application error or a transient; the GPU stays in service and the workload's owner
  is told ([CAT] RESTART_APP).
- watch: the GPU becomes suspect: no new gang lands on it, running work is told and moves at
  its next checkpoint.
- reset_gpu: drain the GPU (its work stops and resumes elsewhere from its checkpoint), reset it.
- reboot_node: drain the node, reboot it ([CAT] RESTART_BM).
- drain_nvlink_domain: stop the work spread over the GPU's NVLink domain (on an NVL72 rack, the
  whole rack's multi-node jobs), reset the GPU.
- service: take the GPU out of service (RMA; [CAT] CONTACT_SUPPORT, CHECK_MECHANICALS).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(str, enum.Enum):
    none = "none"
    watch = "watch"
    reset_gpu = "reset_gpu"
    reboot_node = "reboot_node"
    drain_nvlink_domain = "drain_nvlink_domain"
    service = "service"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {a: i for i, a in enumerate(Action)}


class Scope(enum.IntEnum):
    """Whose work an action stops: nobody's, the GPU's, the node's, the NVLink domain's."""

    none = 0
    gpu = 1
    node = 2
    domain = 3


class Repair(enum.IntEnum):
    """What the provider is asked to do, mildest first."""

    none = 0
    reset = 1
    reboot = 2
    service = 3  # no repair: out of service until an operator returns it


# What each action stops and repairs. An incident's effect is the widest scope and the
# strongest repair over its rows (a reboot and an NVLink drain: the domain's work stops and the
# node reboots), while its class is its worst row.
EFFECT: dict[Action, tuple[Scope, Repair]] = {
    Action.none: (Scope.none, Repair.none),
    Action.watch: (Scope.none, Repair.none),
    Action.reset_gpu: (Scope.gpu, Repair.reset),
    Action.reboot_node: (Scope.node, Repair.reboot),
    Action.drain_nvlink_domain: (Scope.domain, Repair.reset),
    Action.service: (Scope.gpu, Repair.service),
}

# Severity as DCGM's health watches grade it, for operators' views.
SEVERITY = {
    Action.none: "info",
    Action.watch: "warning",
    Action.reset_gpu: "critical",
    Action.reboot_node: "critical",
    Action.drain_nvlink_domain: "critical",
    Action.service: "fatal",
}


@dataclass(frozen=True)
class Rule:
    signal: str  # "xid" or a signal name (see SIGNALS)
    code: int | None  # the Xid, or the recovery action value
    action: Action
    what: str  # plain words for customers and operators
    source: str

    @property
    def fatal(self) -> bool:
        """Whether the work on the GPU stops (the GPU leaves service for a while)."""
        return EFFECT[self.action][0] is not Scope.none


def _xid(code: int, action: Action, what: str, source: str) -> Rule:
    return Rule("xid", code, action, what, source)


A = Action
_APP = "an application error; the GPU stays in service"

XID_RULES: dict[int, Rule] = {
    r.code: r  # type: ignore[misc]
    for r in [
        # --- application errors and transients: RESTART_APP ([CAT], [NVS] NONFATAL) ---------
        _xid(8, A.none, "GPU stopped processing (idle timeout): " + _APP, "[CAT] RESTART_APP"),
        _xid(11, A.none, "invalid or corrupted push buffer: " + _APP, "[CAT] RESTART_APP"),
        _xid(13, A.none, "graphics engine exception: " + _APP, "[CAT] RESTART_APP; [REF]"),
        _xid(25, A.none, "illegal push buffer: " + _APP, "[CAT] RESTART_APP"),
        _xid(31, A.none, "GPU memory page fault (MMU): " + _APP, "[CAT] RESTART_APP; [REF]"),
        _xid(32, A.none, "corrupted push buffer stream: " + _APP, "[CAT] RESTART_APP"),
        *(
            _xid(c, A.none, f"copy engine {i} exception: " + _APP, "[CAT] RESTART_APP")
            for i, c in enumerate((39, 40, 41))
        ),
        # IGNORE in [CAT]; [REF] and [DCGM] (MEM warning) count it as the application's.
        _xid(43, A.none, "GPU channel reset (the application's fault): " + _APP, "[CAT]; [REF]"),
        # WORKFLOW_XID_45: preemptive cleanup, a consequence of another fault or a stop.
        _xid(
            45, A.none, "preemptive cleanup of the application's channels", "[CAT] WORKFLOW_XID_45"
        ),
        _xid(60, A.none, "video processor (SEC2) exception: " + _APP, "[CAT] RESTART_APP"),
        _xid(68, A.none, "video decoder exception: " + _APP, "[CAT] RESTART_APP"),
        _xid(69, A.none, "graphics class error: " + _APP, "[CAT] RESTART_APP"),
        *(
            _xid(c, A.none, f"copy engine exception (Xid {c}): " + _APP, "[CAT] RESTART_APP")
            for c in (70, 71, 72, 75, 76, 77, 85)
        ),
        _xid(80, A.none, "push buffer CRC mismatch: " + _APP, "[CAT] RESTART_APP (A100, H100)"),
        *(
            _xid(c, A.none, f"video/JPEG engine exception (Xid {c}): " + _APP, "[CAT] RESTART_APP")
            for c in (82, 83, 84, 86, 88, 89, *range(96, 106))
        ),
        # A contained memory error: the application restarts; [CAT] adds "reset the GPU when
        # convenient", [DCGM] fails it: the GPU is watched and reset once it is free.
        _xid(
            94,
            A.watch,
            "contained ECC error: the application restarts",
            "[CAT] RESTART_APP; [DCGM]",
        ),
        *(
            _xid(c, A.none, f"copy engine exception (Xid {c}): " + _APP, "[CAT] RESTART_APP")
            for c in range(126, 136)
        ),
        _xid(139, A.none, "optical flow engine exception: " + _APP, "[CAT] RESTART_APP"),
        # RESTART_VM: the VM owning the GPU restarts; the GPU stays in service.
        _xid(
            151,
            A.none,
            "confidential computing key rotation error: the VM restarts",
            "[CAT] RESTART_VM",
        ),
        # CHECK_UVM: RESET_GPU only with UVM/vGPU in use; otherwise nothing to do.
        _xid(159, A.none, "chip interconnect non-data error", "[CAT] CHECK_UVM; [NVS] NONFATAL"),
        # --- watched: warnings ---------------------------------------------------------------
        # IGNORE in [CAT]; a pending page retirement that takes effect at the next reset.
        _xid(
            63,
            A.watch,
            "memory page retirement or row remap pending a reset",
            "[DCGM] MEM warning; [REF]",
        ),
        _xid(92, A.watch, "high single-bit ECC error rate", "[REF]"),
        _xid(
            78,
            A.watch,
            "vGPU failed to start: driver or firmware update needed",
            "[CAT] UPDATE_SWFW",
        ),
        # Follow the driver's recovery action, reported in its own field (RECOVERY_RULES).
        _xid(154, A.watch, "the driver changed its recovery action", "[CAT] XID_154"),
        # --- drain and reset the GPU: RESET_GPU ([CAT], [NVS] FATAL) ---------------------------
        _xid(
            46, A.reset_gpu, "GPU stopped processing", "[CAT] RESET_GPU; [HV] reset_gpu -> service"
        ),
        _xid(
            48,
            A.reset_gpu,
            "uncorrectable (double-bit) ECC error",
            "[CAT] WORKFLOW_XID_48; [DCGM] fail",
        ),
        _xid(62, A.reset_gpu, "internal micro-controller halt", "[CAT] RESET_GPU"),
        _xid(95, A.reset_gpu, "uncontained ECC error", "[CAT] RESET_GPU; [DCGM] fail"),
        _xid(109, A.reset_gpu, "context switch timeout", "[CAT] RESET_GPU"),
        _xid(110, A.reset_gpu, "security fault", "[CAT] RESET_GPU (H100+)"),
        _xid(119, A.reset_gpu, "GSP firmware RPC timeout", "[CAT] RESET_GPU; [DCGM] fail"),
        _xid(120, A.reset_gpu, "GSP firmware error", "[CAT] RESET_GPU; [DCGM] fail"),
        _xid(136, A.reset_gpu, "link training failed", "[CAT] RESET_GPU (H100)"),
        _xid(140, A.reset_gpu, "unrecoverable ECC error escape", "[CAT] RESET_GPU; [DCGM] fail"),
        _xid(143, A.reset_gpu, "GPU initialisation error", "[CAT] RESET_GPU (H100+)"),
        _xid(155, A.reset_gpu, "NVLink software-defined error", "[CAT] RESET_GPU (B100, GB200)"),
        _xid(156, A.reset_gpu, "resource retirement event", "[CAT] RESET_GPU; [NVS] FATAL"),
        _xid(158, A.reset_gpu, "GPU fatal timeout", "[CAT] RESET_GPU"),
        # --- reboot the node: RESTART_BM ----------------------------------------------------
        _xid(79, A.reboot_node, "GPU has fallen off the bus", "[CAT] RESTART_BM; [DCGM] fail"),
        # --- NVLink faults: drain the NVLink domain ----------------------------------------
        _xid(74, A.drain_nvlink_domain, "NVLink error", "[CAT] WORKFLOW_NVLINK_ERR; [DCGM] fail"),
        *(
            _xid(c, A.drain_nvlink_domain, f"NVLink5 error (Xid {c})", "[CAT] WORKFLOW_NVLINK5_ERR")
            for c in range(144, 151)
        ),
        # --- the hardware path: out of service ----------------------------------------------
        # [CAT]'s immediate action is RESET_GPU with CONTACT_SUPPORT to follow; a failed row
        # remap cannot be undone by a reset ([REF], [DCGM] MEM), so the GPU goes for service.
        _xid(64, A.service, "memory row remap failed", "[CAT] CONTACT_SUPPORT; [REF]"),
        _xid(54, A.service, "auxiliary power not connected", "[CAT] CHECK_MECHANICALS"),
        _xid(142, A.service, "video encoder failure", "[CAT] CONTACT_SUPPORT (GB200)"),
    ]
}

# An Xid not in the table (a new driver's, or one the catalog lists as unused on these GPUs):
# watched and shown to operators, never silently ignored, never draining on a guess.
UNKNOWN_XID = Action.watch

# DCGM_FI_DEV_GPU_RECOVERY_ACTION ([NVML] nvmlDeviceGpuRecoveryAction_t; 5..7 on newer drivers).
RECOVERY_RULES: dict[int, Rule] = {
    r.code: r  # type: ignore[misc]
    for r in [
        Rule(
            "recovery_action", 1, A.reset_gpu, "the driver asks for a GPU reset", "[NVML] GPU_RESET"
        ),
        Rule(
            "recovery_action",
            2,
            A.reboot_node,
            "the driver asks for a node reboot",
            "[NVML] NODE_REBOOT",
        ),
        Rule(
            "recovery_action",
            3,
            A.drain_nvlink_domain,
            "the driver asks to drain peer-to-peer traffic",
            "[NVML] DRAIN_P2P",
        ),
        Rule(
            "recovery_action",
            4,
            A.reset_gpu,
            "the driver asks to drain and reset the GPU",
            "[NVML] DRAIN_AND_RESET",
        ),
        Rule(
            "recovery_action",
            5,
            A.drain_nvlink_domain,
            "the driver asks to recover the IMEX domain",
            "[NVML] RECOVER_IMEX_DOMAIN",
        ),
        Rule(
            "recovery_action", 6, A.reset_gpu, "the driver asks for a bus reset", "[NVML] BUS_RESET"
        ),
        Rule(
            "recovery_action",
            7,
            A.reboot_node,
            "the driver asks for a system reboot",
            "[NVML] SYSTEM_REBOOT",
        ),
    ]
}


@dataclass(frozen=True)
class SignalRule(Rule):
    # The signal fires when a counter grows by at least this much between two reports (or,
    # for `hw_slowdown`, when this share of recent reports carry the slowdown bits).
    threshold: float = 1.0


SIGNALS: dict[str, SignalRule] = {
    r.signal: r
    for r in [
        SignalRule(
            "ecc_dbe",
            None,
            A.reset_gpu,
            "uncorrectable (double-bit) ECC errors",
            "[NVS] DCGM_FR_VOLATILE_DBE_DETECTED -> RESET_GPU",
        ),
        SignalRule(
            "row_remap_failure",
            None,
            A.service,
            "memory row remapping failed",
            "[REF] 64 means service; [DCGM] MEM",
        ),
        SignalRule(
            "uncorrectable_remapped_rows",
            None,
            A.reset_gpu,
            "rows remapped after uncorrectable errors: a reset applies them",
            "[NVS] DCGM_FR_PENDING_ROW_REMAP -> RESET_GPU",
        ),
        SignalRule(
            "retired_dbe",
            None,
            A.watch,
            "pages retired after double-bit errors",
            "[DCGM] MEM warning (older GPUs)",
        ),
        SignalRule(
            "nvlink_crc_flit",
            None,
            A.watch,
            "NVLink CRC flit errors",
            "[DCGM] NVLink watch; [REF]",
            100.0,
        ),
        SignalRule(
            "nvlink_replay",
            None,
            A.watch,
            "NVLink replay errors",
            "[DCGM] NVLink watch; [REF]",
            10.0,
        ),
        SignalRule(
            "nvlink_recovery",
            None,
            A.watch,
            "NVLink link recoveries",
            "[DCGM] NVLink watch; [REF]",
            1.0,
        ),
        SignalRule(
            "pcie_replay",
            None,
            A.watch,
            "a burst of PCIe replays",
            "[DCGM] PCIe watch: replay rate above 8/min",
            8.0,
        ),
        SignalRule(
            "hw_slowdown",
            None,
            A.watch,
            "sustained hardware slowdown (thermal or power brake)",
            "[DCGM] clock event reasons HW_SLOWDOWN, HW_THERMAL, HW_POWER_BRAKE",
            0.5,
        ),
        SignalRule(
            "heartbeat_lost",
            None,
            A.reboot_node,
            "the node agent stopped reporting",
            "[REF] heartbeat loss is a fault of its own",
        ),
    ]
}

# Clock event (throttle) reason bits ([DCGM] DCGM_CLOCKS_EVENT_REASON_*, 1:1 with NVML).
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
HW_SLOWDOWN_BITS = THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE
# What slows a GPU down under load (the performance score counts time spent so).
THROTTLED_BITS = HW_SLOWDOWN_BITS | THROTTLE_SW_THERMAL | THROTTLE_SW_POWER_CAP


def rule_for_xid(code: int) -> Rule:
    """The row for Xid `code`; an unknown code is watched (see UNKNOWN_XID)."""
    r = XID_RULES.get(code)
    if r is not None:
        return r
    return Rule("xid", code, UNKNOWN_XID, f"Xid {code}, not in our table: watched", "unknown")


def rule_for_recovery(value: int) -> Rule | None:
    """The row for a recovery action value (None for 0: nothing to do)."""
    if value == 0:
        return None
    r = RECOVERY_RULES.get(value)
    if r is not None:
        return r
    return Rule("recovery_action", value, A.watch, f"unknown recovery action {value}", "unknown")


def worst(rules: list[Rule]) -> Rule:
    """The incident's class: its worst row (the first of equals)."""
    return max(rules, key=lambda r: r.action.rank)


def effect(rules: list[Rule]) -> tuple[Scope, Repair]:
    """What an incident stops and repairs: the widest scope and strongest repair of its rows."""
    scope, repair = Scope.none, Repair.none
    for r in rules:
        s, p = EFFECT[r.action]
        scope, repair = max(scope, s), max(repair, p)
    return scope, repair
