"""Provider drivers: the interface between the control plane and the machines.

`provision` starts what a placed workload needs, `status` says whether it is up, `deprovision`
tears it down. Drivers are called by idempotent tasks that take ids, so every call may repeat.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Literal, Protocol

from app.core.db import as_aware, utcnow
from app.workloads.models import Workload

Status = Literal["booting", "ready", "failed"]


class Provider(Protocol):
    def provision(self, w: Workload, since: datetime) -> float:
        """Start provisioning (idempotent); returns the seconds after which to ask `status`."""
        ...

    def status(self, w: Workload, since: datetime) -> Status: ...

    def deprovision(self, w: Workload) -> None: ...

    def run_for(self, w: Workload) -> float | None:
        """Seconds after which the workload's process exits by itself, if the provider knows
        (a real one does not: its node agent reports the exit through the API)."""
        ...


class SimulatedProvider:
    """Boots allocations with a realistic delay and can fail, without any machine.

    Stateless, so a crashed worker loses nothing: each workload's boot time (the configured
    base, +-50%, more for VMs) and whether it fails are derived from its id and generation, and
    `status` compares them with when provisioning began."""

    def __init__(self, boot_seconds: float, fail_rate: float = 0.0):
        self.boot_seconds = boot_seconds
        self.fail_rate = fail_rate

    def _draw(self, w: Workload, salt: str) -> float:
        d = hashlib.blake2b(f"{salt}:{w.id}:{w.preemptions}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "big") / 2**64

    def boot_time(self, w: Workload) -> float:
        base = self.boot_seconds * (2.0 if w.kind == "vm" else 1.0)
        return base * (0.5 + self._draw(w, "boot"))

    def provision(self, w: Workload, since: datetime) -> float:
        return max(0.0, self.boot_time(w) - (utcnow() - as_aware(since)).total_seconds())

    def status(self, w: Workload, since: datetime) -> Status:
        if (utcnow() - as_aware(since)).total_seconds() < self.boot_time(w):
            return "booting"
        return "failed" if self._draw(w, "fail") < self.fail_rate else "ready"

    def deprovision(self, w: Workload) -> None:
        return None

    def run_for(self, w: Workload) -> float | None:
        return float(w.run_for_s) if w.run_for_s else None


def get_provider() -> Provider:
    from app.core.config import get_settings

    s = get_settings()
    return SimulatedProvider(s.sim_boot_seconds, s.sim_fail_rate)
