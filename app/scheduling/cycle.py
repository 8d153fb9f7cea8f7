"""The I/O edge of placement: a region's snapshot from the database, one scheduling cycle of the
pure core (`app.placement.queueing`), and the plan applied in the same transaction.

Safety, in layers:
- one decider per region at a time: a transaction-scoped advisory lock (PostgreSQL; the
  embedded SQLite has one writer anyway), so different regions run in parallel;
- every workload the plan touches is re-read `FOR UPDATE` and must still have the state and
  generation the snapshot saw, else the whole plan is dropped and the cycle runs again;
- the database itself refuses double allocation: `gpu_usage` CHECKs (a GPU never holds more than
  1000 milli or its memory) and a partial unique index on live MIG slice claims.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.logging import get_logger
from app.models.workloads import Workload
from app.placement.queueing import (
    QueueConfig,
)
from app.scheduling import pending
from app.scheduling.apply import CycleReport, apply_plan, describe, disclose
from app.scheduling.world import EPOCH, IS_QUEUED, clock, load, qworkload

log = get_logger(__name__)


def region_lock_key(region: str) -> int:
    """The advisory lock key (a signed bigint) of a region's placement decisions."""
    key = int.from_bytes(hashlib.blake2b(f"placement:{region}".encode(), digest_size=8).digest())
    return key - (1 << 63)


def lock_region(session: Session, region: str) -> bool:
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(
        session.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": region_lock_key(region)})
    )


def run_cycle(session: Session, region: str, config: QueueConfig | None = None) -> CycleReport:
    """One placement cycle for `region`, applied in the caller's transaction (which the caller
    commits). Raises PlanConflict if a workload changed under it (roll back and run again)."""
    waiting = session.scalar(
        select(Workload.id)
        .where(Workload.region == region, IS_QUEUED, Workload.hold.is_(None))
        .limit(1)
    )
    if waiting is None:  # nothing to decide: skip the snapshot
        return CycleReport(region, ran=True)
    if not lock_region(session, region):
        return CycleReport(region, ran=False)
    now = utcnow()
    loaded = load(session, region, kept=True)
    if loaded is None:  # no nodes (left): its work waits for capacity to be registered
        return CycleReport(region, ran=True)
    snap = loaded.world.snap
    mark = snap.checkpoint()
    try:
        report = apply_plan(session, region, loaded, now, config)
        pending.record(session, region, loaded, report, now)  # why the rest waits
        return report
    finally:
        # The kept snapshot goes back to what the database held before this cycle: what the
        # cycle wrote (if it commits) comes back through the next cycle's diff.
        snap.rollback(mark)


@dataclass
class DryRun:
    placeable_now: bool
    placement: list[dict]
    preempts: list[str]  # the asking tenant's own
    preempts_others: list[dict]  # other tenants': how many of each priority
    expected_start: datetime | None
    reason: str


def dry_run(session: Session, w: Workload, whole: bool = False) -> DryRun:
    """What the next cycle would do with `w` (not stored) if it were at the head of its queue:
    where it lands now, whom it preempts, or when it is expected to start. Reads only.
    `whole`: a running elastic gang at its full size, in place of itself (its GPUs free)."""
    loaded = load(session, w.region or "", extra_tenant=w.tenant_id)
    if loaded is None:
        return DryRun(False, [], [], [], None, "the region has no nodes")
    now = utcnow()
    q = qworkload(w)
    if whole:
        q = replace(q, request=replace(q.request, replicas=w.replicas), alloc_ids=())
    ans = loaded.scheduler().what_if(
        q,
        clock(now),
        [qworkload(x) for x in loaded.queued],
        loaded.running(),
        replacing=str(w.id) if whole else None,
    )
    start = None
    if ans.expected_start is not None:
        start = EPOCH + timedelta(seconds=ans.expected_start)
    held = {str(wid): h for wid, h in loaded.holding.items()}
    own, others = disclose(
        w.tenant_id,
        [(v, held[v].tenant_id, held[v].qw.priority) for v in ans.preempts if v in held],
    )
    return DryRun(
        ans.placeable_now,
        [describe(loaded.world, b) for b in ans.bindings],
        own,
        others,
        start,
        ans.reason,
    )
