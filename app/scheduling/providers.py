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
from app.models.agents import AgentNode
from app.models.workloads import Allocation, SimulatedFault, Workload

Status = Literal["booting", "ready", "failed"]
RepairKind = Literal["reset", "reboot"]


class Provider(Protocol):
    name: str

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

    def poll_seconds(self, w: Workload) -> float:
        """How soon to ask `status` again about a workload still booting."""
        ...


class SimulatedProvider:
    """Boots allocations with a realistic delay and can fail, without any machine.

    Stateless, so a crashed worker loses nothing: each workload's boot time (the configured
    base, +-50%, more for VMs) and whether it fails are derived from its id and generation, and
    `status` compares them with when provisioning began."""

    name = "simulated"

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

    def poll_seconds(self, w: Workload) -> float:
        return SIMULATED_POLL_SECONDS

    def repair(self, repair_id: str, kind: RepairKind) -> float:
        return self.reset_seconds if kind == "reset" else self.reboot_seconds

    def repaired(self, repair_id: str, kind: RepairKind, node: str | None = None) -> bool:
        if node is not None and node in self.broken.get("repair", frozenset()):
            return False
        d = hashlib.blake2b(f"repair:{repair_id}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "big") / 2**64 >= self.repair_fail_rate


SIMULATED_POLL_SECONDS = 0.5
FAILED_RUNS = frozenset({"exited", "failed_to_start", "lost"})


class AgentProvider:
    """Work on nodes that run an agent (app/agents). Provisioning is the agents starting the
    replicas' processes, which they report on the allocations; nothing is torn down here: a
    workload that stops leaves its nodes' desired state, and their agents stop its processes.
    Runs end when the agents report their exits, so there is no declared run length. Repairs
    stay the simulated provider's until agents carry them out (the fleet lifecycle issue)."""

    name = "node agent"
    # A report that a run started sends `workloads.check` at once; this is the fallback.
    POLL_SECONDS = 5.0

    def __init__(self, session: Session, start_timeout_s: float, repairs: SimulatedProvider):
        self.session = session
        self.start_timeout_s = start_timeout_s
        self._repairs = repairs

    def provision(self, w: Workload, since: datetime) -> float:
        left = self.start_timeout_s - (utcnow() - as_aware(since)).total_seconds()
        return max(0.0, min(self.POLL_SECONDS, left))

    def status(self, w: Workload, since: datetime) -> Status:
        with self.session.no_autoflush:  # as in `PerNodeProvider.for_workload`
            runs = self.session.execute(
                select(Allocation.run_state, Allocation.exit_code, Allocation.exit_signal).where(
                    Allocation.workload_id == w.id, Allocation.released_at.is_(None)
                )
            ).all()
        if any(
            state in FAILED_RUNS and not (state == "exited" and code == 0 and not signal)
            for state, code, signal in runs
        ):
            return "failed"
        if runs and all(state is not None for state, _, _ in runs):
            return "ready"
        if (utcnow() - as_aware(since)).total_seconds() >= self.start_timeout_s:
            return "failed"
        return "booting"

    def deprovision(self, w: Workload) -> None:
        return None

    def run_for(self, w: Workload) -> float | None:
        return None

    def repair(self, repair_id: str, kind: RepairKind) -> float:
        return self._repairs.repair(repair_id, kind)

    def repaired(self, repair_id: str, kind: RepairKind, node: str | None = None) -> bool:
        return self._repairs.repaired(repair_id, kind, node)

    def poll_seconds(self, w: Workload) -> float:
        return self.POLL_SECONDS


class PerNodeProvider:
    """The provider is chosen per node: a workload placed on a node with an agent is the agent
    provider's, any other the simulated one's (the big demo fleet, the simulator). Nothing else
    in the control plane knows which. Which nodes have agents is read once per name asked."""

    name = "per node"

    def __init__(self, session: Session | None, simulated: SimulatedProvider, timeout_s: float):
        self.session = session
        self.simulated = simulated
        self.agent = AgentProvider(session, timeout_s, simulated) if session is not None else None
        self._agent_nodes: dict[str, bool] = {}

    def for_workload(self, w: Workload) -> Provider:
        if self.agent is None or self.session is None:
            return self.simulated
        names = {p["node"] for p in w.placement or []}
        unknown = names - self._agent_nodes.keys()
        if unknown:
            # Never flushing: callers hold moved workloads that `lifecycle.write` writes in one
            # batch, checked by generation (an autoflush would write them first, one by one).
            with self.session.no_autoflush:
                found = set(
                    self.session.scalars(
                        select(AgentNode.node_name).where(AgentNode.node_name.in_(sorted(unknown)))
                    )
                )
            self._agent_nodes.update({n: n in found for n in unknown})
        return self.agent if any(self._agent_nodes[n] for n in names) else self.simulated

    def provision(self, w: Workload, since: datetime) -> float:
        return self.for_workload(w).provision(w, since)

    def status(self, w: Workload, since: datetime) -> Status:
        return self.for_workload(w).status(w, since)

    def deprovision(self, w: Workload) -> None:
        self.for_workload(w).deprovision(w)

    def run_for(self, w: Workload) -> float | None:
        return self.for_workload(w).run_for(w)

    def poll_seconds(self, w: Workload) -> float:
        return self.for_workload(w).poll_seconds(w)

    def repair(self, repair_id: str, kind: RepairKind) -> float:
        return self.simulated.repair(repair_id, kind)

    def repaired(self, repair_id: str, kind: RepairKind, node: str | None = None) -> bool:
        return self.simulated.repaired(repair_id, kind, node)


def get_provider(session: Session | None = None) -> PerNodeProvider:
    """The provider for the workloads of this session: per node, the agent's where one runs,
    else the simulated one (which, with a session, knows its injected faults)."""
    s = get_settings()
    broken: dict[str, frozenset[str]] = {}
    if session is not None:
        rows = session.execute(select(SimulatedFault.fails, SimulatedFault.node)).all()
        for fails in ("boot", "repair"):
            broken[fails] = frozenset(n for f, n in rows if f == fails)
    simulated = SimulatedProvider(
        s.sim_boot_seconds,
        s.sim_fail_rate,
        reset_seconds=s.sim_reset_seconds,
        reboot_seconds=s.sim_reboot_seconds,
        repair_fail_rate=s.sim_repair_fail_rate,
        broken=broken,
    )
    return PerNodeProvider(session, simulated, s.agent_start_timeout_seconds)


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
