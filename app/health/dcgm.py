"""What DCGM sends and what is taken from it: each field's meaning to the health loop
(`FIELDS`), the values it may take (`DOMAINS`), why a sample is rejected, and dcgm-exporter's
Prometheus text parsed into samples and their targets. Nothing here keeps state."""

from __future__ import annotations

import math
import re

from prometheus_client.parser import parse_labels

from app.core.errors import ValidationFailed
from app.health.schemas import HOST_PATTERN, UUID_PATTERN

# What each DCGM field is to the health loop (anything else is counted and ignored).
XID, RECOVERY, COUNTER, FLAG, THROTTLE, UTIL, CLOCK, GAUGE = range(8)
FIELDS: dict[str, tuple[int, str]] = {
    "DCGM_FI_DEV_XID_ERRORS": (XID, "xid"),
    "DCGM_FI_DEV_GPU_RECOVERY_ACTION": (RECOVERY, "recovery_action"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (COUNTER, "ecc_dbe"),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": (COUNTER, "ecc_sbe"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (COUNTER, "uncorrectable_remapped_rows"),
    "DCGM_FI_DEV_RETIRED_DBE": (COUNTER, "retired_dbe"),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": (COUNTER, "nvlink_crc_flit"),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": (COUNTER, "nvlink_replay"),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": (COUNTER, "nvlink_recovery"),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": (COUNTER, "pcie_replay"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": (FLAG, "row_remap_failure"),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": (THROTTLE, "throttle"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": (THROTTLE, "throttle"),  # the newer name, same field
    "DCGM_FI_DEV_GPU_UTIL": (UTIL, "util"),
    "DCGM_FI_DEV_SM_CLOCK": (CLOCK, "sm_clock"),
    "DCGM_FI_DEV_GPU_TEMP": (GAUGE, "gpu_temp"),
    "DCGM_FI_DEV_MEMORY_TEMP": (GAUGE, "memory_temp"),
    "DCGM_FI_DEV_POWER_USAGE": (GAUGE, "power_w"),
    "DCGM_FI_DEV_FB_USED": (GAUGE, "fb_used_mib"),
}
# What each field's value may be: (lowest, highest, whole numbers only). Outside it, a sample is
# rejected. DCGM marks a value it has not got (blank, not found, not supported, no permission)
# with the top of its type's range: 0x7ffffff0 and up (int32 fields), 0x7ffffffffffffff0 and up
# (int64 fields); those are never a reading either. NaN is a gauge's "no reading" (taken in,
# nothing learned) and no value at all for an event-like field; Inf is never a value.
INT32_BLANK = 0x7FFFFFF0
INT64_BLANK = 0x7FFFFFFFFFFFFFF0
_COUNT = (0.0, float(INT64_BLANK - 1), True)
DOMAINS: dict[str, tuple[float, float, bool]] = {
    "xid": (0.0, float(INT32_BLANK - 1), True),  # 0: no Xid; NVIDIA's codes are small
    "recovery_action": (0.0, float(INT32_BLANK - 1), True),  # 0: none (NVML's values: 0-4)
    "ecc_dbe": _COUNT,
    "ecc_sbe": _COUNT,
    "uncorrectable_remapped_rows": _COUNT,
    "retired_dbe": _COUNT,
    "nvlink_crc_flit": _COUNT,
    "nvlink_replay": _COUNT,
    "nvlink_recovery": _COUNT,
    "pcie_replay": _COUNT,
    "row_remap_failure": (0.0, 1.0, True),  # a flag
    "throttle": _COUNT,  # bit flags
    "util": (0.0, 100.0, False),  # %
    "sm_clock": (0.0, 10_000.0, False),  # MHz
    "gpu_temp": (-50.0, 200.0, False),  # C
    "memory_temp": (-50.0, 200.0, False),
    "power_w": (0.0, 10_000.0, False),  # W (a GB200 superchip draws under 3 kW)
    "fb_used_mib": (0.0, float(1 << 24), False),  # MiB (16 TiB)
}
_NAN_IS_NO_READING = frozenset({UTIL, CLOCK, GAUGE})
# Why a sample is rejected (each counted in the answer and on /metrics).
OUT_OF_RANGE = "out_of_range"  # outside its field's domain (or not a whole number where one is)
NOT_FINITE = "not_finite"  # Inf, or NaN where a reading cannot be missing
FUTURE_TIMESTAMP = "future_timestamp"  # stamped more than MAX_SKEW_S ahead of the server
BAD_LABEL = "bad_label"  # a control character in a label, or a malformed Hostname, gpu or UUID
UUID_CONFLICT = "uuid_conflict"  # a UUID another GPU's record holds, or on another node
REJECTED_TARGETS = frozenset({BAD_LABEL, UUID_CONFLICT})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HOST = re.compile(HOST_PATTERN)
_UUID = re.compile(UUID_PATTERN)
_INDEX = re.compile(r"[0-9]|[1-5][0-9]|6[0-3]")  # as the fleet numbers GPUs: 0..63
_MIN_MS, _MAX_MS = -(1 << 63), (1 << 63) - 1  # a sample's timestamp: int64 milliseconds


def invalid(kind: int, value: float) -> str | None:
    """Why a value outside its field's domain (`DOMAINS`) is rejected; None for NaN where it is
    a gauge's "no reading"."""
    if value != value:
        return None if kind in _NAN_IS_NO_READING else NOT_FINITE
    if value in (math.inf, -math.inf):
        return NOT_FINITE
    return OUT_OF_RANGE


def well_formed(host: str | None, index: str | None, uuid_: str | None) -> bool:
    """Whether a target's labels can name a fleet GPU (the REST schema's patterns)."""
    return (
        (host is None or _HOST.fullmatch(host) is not None)
        and (index is None or _INDEX.fullmatch(index) is not None)
        and (uuid_ is None or len(uuid_) <= 64 and _UUID.fullmatch(uuid_) is not None)
    )


def parse_exposition(text: str) -> tuple[list[tuple], dict[str, tuple | str]]:
    """dcgm-exporter's Prometheus text -> (samples, targets): samples as (line number, label
    text, metric name, value, timestamp in epoch seconds or None), targets as label text ->
    (Hostname, gpu, UUID), or BAD_LABEL for a set with a control character (its samples are
    rejected). The label sets are parsed by prometheus-client's parser, once per distinct set:
    dcgm-exporter repeats each GPU's set once per field. Raises ValidationFailed naming the
    first malformed line."""
    samples: list[tuple] = []
    targets: dict[str, tuple | str] = {}
    append = samples.append
    lineno = 0
    for line in text.split("\n"):
        lineno += 1
        if not line or line[0] == "#" or line.isspace():
            continue
        try:
            brace = line.find("{")
            if brace >= 0:
                close = line.rindex("}")
                name = line[:brace]
                labels = line[brace + 1 : close]
                rest = line[close + 1 :].split()
                if labels not in targets:
                    parsed = parse_labels(labels, False)
                    targets[labels] = (
                        BAD_LABEL
                        if _CONTROL.search(labels)
                        else (parsed.get("Hostname"), parsed.get("gpu"), parsed.get("UUID"))
                    )
            else:
                parts = line.split()
                name, rest, labels = parts[0], parts[1:], ""
                targets.setdefault("", (None, None, None))
            if not 1 <= len(rest) <= 2 or not name.isidentifier() and ":" not in name:
                raise ValueError("expected: name{labels} value [timestamp]")
            value = float(rest[0])
            ts = None
            if len(rest) == 2:
                ms = int(rest[1])
                if not _MIN_MS <= ms <= _MAX_MS:
                    raise ValueError("the timestamp is not a 64-bit integer (milliseconds)")
                ts = ms / 1000.0
        except ValueError as exc:
            raise ValidationFailed(
                f"Line {lineno} is not a Prometheus sample: {exc}.",
                code="malformed_sample",
                line=lineno,
                sample=line[:200],
            ) from None
        append((lineno, labels, name, value, ts))
    return samples, targets
