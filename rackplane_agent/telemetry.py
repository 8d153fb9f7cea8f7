"""GPU telemetry for the control plane's health loop, as Prometheus text.

With `--dcgm-exporter URL` the exporter's text is scraped and forwarded as it is. Without one,
on a host where NVML answers, a few fields are sampled from NVML and rendered with DCGM's
names and dcgm-exporter's labels (`gpu`, `UUID`, `Hostname`), so the server reads both alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rackplane_agent.logfmt import kv

log = logging.getLogger("rackplane_agent.telemetry")

HELP = {
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
}


@dataclass(frozen=True)
class Sample:
    field: str
    gpu: int
    uuid: str
    value: float


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(samples: list[Sample], hostname: str) -> str:
    """dcgm-exporter's text format: a HELP and TYPE line per field, then a line per GPU."""
    lines: list[str] = []
    for field in HELP:
        rows = [s for s in samples if s.field == field]
        if not rows:
            continue
        lines += [f"# HELP {field} {HELP[field]}", f"# TYPE {field} gauge"]
        for s in rows:
            labels = f'gpu="{s.gpu}",UUID="{_label(s.uuid)}",Hostname="{_label(hostname)}"'
            lines.append(f"{field}{{{labels}}} {_number(s.value)}")
    return "\n".join(lines) + "\n" if lines else ""


class DcgmScraper:
    """dcgm-exporter's /metrics, as it is."""

    def __init__(self, url: str, timeout: float = 5.0):
        self.url = url
        self.timeout = timeout

    def collect(self) -> str | None:
        import httpx

        response = httpx.get(self.url, timeout=self.timeout)
        response.raise_for_status()
        return response.text

    def close(self) -> None:
        pass


class NvmlSampler:
    """Temperature, SM clock and power from NVML, and Xids from its event set (the last Xid
    seen since the previous sample, else 0, as dcgm-exporter reports it)."""

    def __init__(self, nvml: Any, hostname: str):
        self.nvml = nvml
        self.hostname = hostname
        self._handles = [
            nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())
        ]
        self._uuids = [self._str(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._events = None
        try:
            events = nvml.nvmlEventSetCreate()
            for h in self._handles:
                try:
                    nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, events)
                except Exception as exc:  # not supported on this GPU
                    log.info(kv("xid_events_unavailable", error=exc))
            self._events = events
        except Exception as exc:
            log.info(kv("xid_events_unavailable", error=exc))

    @staticmethod
    def _str(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def _xids(self) -> dict[int, int]:
        """The last Xid per GPU index since the previous call."""
        seen: dict[int, int] = {}
        if self._events is None:
            return seen
        for _ in range(1000):
            try:
                data = self.nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # NVMLError_Timeout: nothing (more) pending
                break
            try:
                index = self.nvml.nvmlDeviceGetIndex(data.device)
            except Exception:
                continue
            seen[int(index)] = int(data.eventData)
        return seen

    def samples(self) -> list[Sample]:
        nvml = self.nvml
        xids = self._xids()
        out: list[Sample] = []
        for i, (h, uuid) in enumerate(zip(self._handles, self._uuids, strict=True)):
            readings = {
                "DCGM_FI_DEV_GPU_TEMP": lambda h=h: nvml.nvmlDeviceGetTemperature(
                    h, nvml.NVML_TEMPERATURE_GPU
                ),
                "DCGM_FI_DEV_SM_CLOCK": lambda h=h: nvml.nvmlDeviceGetClockInfo(
                    h, nvml.NVML_CLOCK_SM
                ),
                "DCGM_FI_DEV_POWER_USAGE": lambda h=h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            }
            for field, read in readings.items():
                try:
                    out.append(Sample(field, i, uuid, float(read())))
                except Exception:
                    continue  # not supported on this GPU
            out.append(Sample("DCGM_FI_DEV_XID_ERRORS", i, uuid, float(xids.get(i, 0))))
        return out

    def collect(self) -> str | None:
        return render(self.samples(), self.hostname) or None

    def close(self) -> None:
        if self._events is not None:
            try:
                self.nvml.nvmlEventSetFree(self._events)
            except Exception:
                pass
