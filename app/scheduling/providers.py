"""Provider drivers: the interface between the control plane and the machines.

`provision` starts what a placed workload needs, `status` says whether it is up, `deprovision`
tears it down. Drivers are called by idempotent tasks that take ids, so every call may repeat.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime
from typing import Literal, Protocol

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.models.workloads import SimulatedFault, Workload

Status = Literal["booting", "ready", "failed"]
RepairKind = Literal["reset", "reboot"]


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

    def repair(self, repair_id: str, kind: RepairKind) -> float:
        """Start a GPU reset or a node reboot (idempotent); the seconds it takes."""
        ...

    def repaired(self, repair_id: str, kind: RepairKind, node: str | None = None) -> bool:
        """Whether the finished repair (of `node`) left the hardware working."""
        ...


class SimulatedProvider:
    """Boots allocations with a realistic delay and can fail, without any machine.

    Stateless, so a crashed worker loses nothing: each workload's boot time (the configured
    base, +-50%, more for VMs) and whether it fails are derived from its id and generation, and
    `status` compares them with when provisioning began."""

    def __init__(
        self,
        boot_seconds: float,
        fail_rate: float = 0.0,
        *,
        reset_seconds: float = 5.0,
        reboot_seconds: float = 180.0,
        repair_fail_rate: float = 0.0,
        broken: dict[str, frozenset[str]] | None = None,
    ):
        self.boot_seconds = boot_seconds
        # Injected faults (chaos): node names whose boots ("boot") or repairs ("repair") fail.
        self.broken = broken or {}
        self.fail_rate = fail_rate
        self.reset_seconds = reset_seconds
        self.reboot_seconds = reboot_seconds
        self.repair_fail_rate = repair_fail_rate

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
        if self.broken.get("boot") and any(
            p["node"] in self.broken["boot"] for p in w.placement or []
        ):
            return "failed"
        return "failed" if self._draw(w, "fail") < self.fail_rate else "ready"

    def deprovision(self, w: Workload) -> None:
        return None

    def run_for(self, w: Workload) -> float | None:
        return float(w.run_for_s) if w.run_for_s else None

    def repair(self, repair_id: str, kind: RepairKind) -> float:
        return self.reset_seconds if kind == "reset" else self.reboot_seconds

    def repaired(self, repair_id: str, kind: RepairKind, node: str | None = None) -> bool:
        if node is not None and node in self.broken.get("repair", frozenset()):
            return False
        d = hashlib.blake2b(f"repair:{repair_id}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "big") / 2**64 >= self.repair_fail_rate


def get_provider(session: Session | None = None) -> Provider:
    """The configured provider; with a session, the simulated one knows its injected faults."""
    s = get_settings()
    broken: dict[str, frozenset[str]] = {}
    if session is not None:
        rows = session.execute(select(SimulatedFault.fails, SimulatedFault.node)).all()
        for fails in ("boot", "repair"):
            broken[fails] = frozenset(n for f, n in rows if f == fails)
    return SimulatedProvider(
        s.sim_boot_seconds,
        s.sim_fail_rate,
        reset_seconds=s.sim_reset_seconds,
        reboot_seconds=s.sim_reboot_seconds,
        repair_fail_rate=s.sim_repair_fail_rate,
        broken=broken,
    )


def break_nodes(
    session: Session, nodes: list[str], fails: Literal["boot", "repair"], source: uuid.UUID
) -> None:
    """The simulated provider fails to boot on (or to repair) these nodes until mended."""
    now = utcnow()
    session.add_all(
        [SimulatedFault(node=n, fails=fails, source=source, created_at=now) for n in nodes]
    )
    session.flush()


def mend(session: Session, source: uuid.UUID) -> None:
    session.execute(delete(SimulatedFault).where(SimulatedFault.source == source))
