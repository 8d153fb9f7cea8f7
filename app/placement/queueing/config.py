"""The queue's configuration: priority classes, tenant quotas, the cycle's settings and the
named baselines. The bottom of the package: it imports nothing of it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PriorityClass:
    name: str
    value: int
    # Preemptible work is cheaper and can always be evicted (no minimum runtime, no cool-down).
    preemptible: bool = False


DEFAULT_PRIORITY_CLASSES: dict[str, PriorityClass] = {
    p.name: p
    for p in (
        PriorityClass("production", 1000),
        PriorityClass("training", 500),
        PriorityClass("research", 100),
        PriorityClass("preemptible", 0, preemptible=True),
    )
}


@dataclass(frozen=True)
class TenantQuota:
    """Per GPU model, in GPU-equivalent milli. A model missing from `limit` has no limit beyond
    the fleet; a model missing from `guaranteed` has no guarantee (all its use is borrowed)."""

    guaranteed: Mapping[str, int] = field(default_factory=dict)
    limit: Mapping[str, int] = field(default_factory=dict)
    weight: float = 1.0

    def guarantee(self, model: str) -> int:
        return self.guaranteed.get(model, 0)

    def cap(self, model: str) -> int | None:
        return self.limit.get(model)


ORDERS = ("arrival", "priority", "fair-share")
ON_BLOCKED = ("skip", "stop", "reserve")
# The phases a cycle may run, in the order `PHASES` (scheduler.py) maps them to functions.
PHASE_NAMES = ("reclaim", "fair-share", "allocate", "preempt", "backfill", "defragment")


@dataclass(frozen=True)
class QueueConfig:
    phases: tuple[str, ...] = ("reclaim", "allocate", "preempt", "backfill", "defragment")
    order: str = "fair-share"
    on_blocked: str = "reserve"
    placement_policy: str = "best-fit"
    max_reservations: int = 1
    half_life: float = 24 * 3600.0  # usage history decay (seconds)
    history_weight: float = 0.5  # fair share: 0 = current use only, 1 = decayed history only
    grace_period: float = 120.0  # a victim may checkpoint for this long before it stops
    # ... or longer, up to this, when its checkpoint takes longer (0: the grace period only).
    checkpoint_wait: float = 300.0
    min_runtime: float = 600.0  # never evicted before running this long (non-preemptible)
    cooldown: float = 1800.0  # never evicted again this soon after an eviction
    starvation_factor: float = 1.0  # waited this many times its max runtime: goes first
    # True: priority orders the whole queue and a higher class may evict any tenant's lower
    # class. False: priority orders work within a tenant; across tenants the fair share decides,
    # and only preemptible work of other tenants may be evicted for priority.
    priority_across_tenants: bool = True
    # None: work-conserving, a tenant may use whatever the others leave. A number >= 1: a tenant
    # holding this multiple of its fair share of a GPU model (the weighted max-min split among
    # tenants with work waiting for it, never below its guarantee) starts nothing more there
    # while others wait. Below it, any workload may start, so none starves. Stricter shares,
    # longer queues.
    share_cap: float | None = None
    max_victims: int = 64
    # Defragment: per cycle, waiting multi-GPU workloads that may move small work off the nodes
    # closest to free, moving at most this fraction of the GPUs they need.
    defragment_per_cycle: int = 4
    defragment_max_moved: float = 0.75  # below 1: a node to clear has a free GPU already
    defragment_depth: int = 32  # waiting workloads the phase examines per cycle
    reclaim_depth: int = 4  # per tenant and cycle: pending workloads that may reclaim
    backfill_depth: int = 200  # workloads the backfill phase examines per cycle
    priority_classes: Mapping[str, PriorityClass] = field(
        default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES)
    )

    def validate(self) -> None:
        unknown = [p for p in self.phases if p not in PHASE_NAMES]
        if unknown:
            raise ValueError(f"unknown phases {unknown}; known: {', '.join(PHASE_NAMES)}")
        if self.order not in ORDERS:
            raise ValueError(f"order is one of {ORDERS}")
        if self.on_blocked not in ON_BLOCKED:
            raise ValueError(f"on_blocked is one of {ON_BLOCKED}")
        if not 0 <= self.defragment_max_moved < 1:
            raise ValueError("0 <= defragment_max_moved < 1")
        if self.share_cap is not None and self.share_cap < 1:
            raise ValueError("share_cap is None or at least 1")
        if self.half_life <= 0 or not 0 <= self.history_weight <= 1:
            raise ValueError("half_life > 0 and 0 <= history_weight <= 1")


BASELINES: dict[str, QueueConfig] = {
    # What a default Kubernetes scheduler does: arrival order, first fit, no preemption.
    "fifo": QueueConfig(
        phases=("allocate",), order="arrival", on_blocked="skip", placement_policy="first-fit"
    ),
    # Strict priority: the head blocks everything behind it; it may evict lower priorities.
    "priority": QueueConfig(phases=("allocate", "preempt"), order="priority", on_blocked="stop"),
    "default": QueueConfig(),
    # Shares before speed: across tenants the fair share orders the queue (priority only within
    # a tenant), and no tenant starts work beyond 1.1x its fair share while others wait.
    "strict-share": QueueConfig(share_cap=1.1, priority_across_tenants=False),
}
