"""Fair-share queueing over a snapshot: quotas with borrowing, priorities, checkpoint-aware
preemption, reservations with backfill, and what-if answers. Pure: decisions, no I/O.

One scheduling cycle runs named phases in a configured order (default: reclaim, allocate,
preempt, backfill, defragment). Every phase is a function of one `CycleState`, passed to it (the
snapshot, usage per tenant and GPU model, the queue): it reads and changes it and appends its
decisions to the `CycleResult`:

- **reclaim**: a tenant below its guarantee whose work does not fit evicts *borrowed* work
  (of tenants above their guarantee, never of a higher priority), cheapest loss first;
- **allocate**: the queue in order (arrival, strict priority, or priority then fair share;
  work waiting longer than its declared runtime goes first whatever its class),
  admitting what fits under each tenant's limit. What does not fit is skipped (`skip`), ends
  the walk (`stop`), or ends the walk and goes to the backfill phase for a reservation
  (`reserve`). A reservation that has come due is served before the walk;
- **preempt**: a blocked workload evicts workloads of a strictly lower priority (or of a
  preemptible class), cheapest loss first;
- **backfill**: the blocked head gets a reservation (GPUs and the earliest start from the
  declared maximum runtimes of what runs), and the rest of the queue may start only where it
  cannot delay it: on capacity outside the reservation, or ending before it starts;
- **defragment**: multi-GPU work still waiting while the free GPUs lie scattered moves small
  work (never of a higher priority) off the nodes closest to free, onto free GPUs elsewhere.

Victims stop after the grace period, or once their checkpoint is written when that takes
longer but no longer than `checkpoint_wait`; only work that can checkpoint so is moved.

By default the queue is work-conserving: a tenant may use what the others cannot. With
`share_cap`, every phase treats a tenant holding that multiple of its fair share (weighted max-min
among tenants with work waiting) like one at its limit: stricter shares, longer queues.

Units: quotas and usage are GPU-equivalents in milli (whole GPU 1000, MIG slice memory/8, a
fractional share its milli), per GPU model.

One module per concern, each importing only those below it:

- config.py: priority classes, tenant quotas, `QueueConfig` and the named `BASELINES`;
- decisions.py: `Workload` and what a cycle decides (admissions, evictions, reservations);
- fairshare.py: the decayed `UsageHistory` and the weighted max-min `water_fill`;
- state.py: `CycleState`, the cycle's state and plumbing (snapshot, undo log, usage, failure
  caches, holds), and the two small interfaces it reads (the scheduler, the queue walk);
- admission.py: quotas and fair share, placing and admitting, the queue walk, allocate;
- preemption.py: victim choice, eviction, and the reclaim, fair-share and preempt phases;
- backfill.py: reservations and the backfill phase;
- defragment.py: the defragment phase;
- scheduler.py: the cycle driver (`Scheduler`: the phases in order, what-ifs) and `PHASES`.
"""

from __future__ import annotations

from app.placement.queueing.config import (
    BASELINES,
    DEFAULT_PRIORITY_CLASSES,
    ON_BLOCKED,
    ORDERS,
    PHASE_NAMES,
    PriorityClass,
    QueueConfig,
    TenantQuota,
)
from app.placement.queueing.decisions import (
    Admission,
    CycleResult,
    Eviction,
    Reservation,
    WhatIf,
    Workload,
)
from app.placement.queueing.fairshare import UsageHistory, water_fill
from app.placement.queueing.scheduler import PHASES, Scheduler
from app.placement.queueing.state import RESERVATION_TENANT, CycleState

__all__ = [
    "BASELINES",
    "DEFAULT_PRIORITY_CLASSES",
    "ON_BLOCKED",
    "ORDERS",
    "PHASES",
    "PHASE_NAMES",
    "RESERVATION_TENANT",
    "Admission",
    "CycleResult",
    "CycleState",
    "Eviction",
    "PriorityClass",
    "QueueConfig",
    "Reservation",
    "Scheduler",
    "TenantQuota",
    "UsageHistory",
    "WhatIf",
    "Workload",
    "water_fill",
]
