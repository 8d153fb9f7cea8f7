"""Fleet and health metrics for Prometheus, read from the database at scrape time.

The health loop runs in workers and the API in several processes: counters kept in one
process's memory would show a fraction of the truth. These are read from the rows that record
it (GPU states, incidents, repairs, workloads) at each scrape, a handful of grouped queries.
The exception is what leaves no row: telemetry samples rejected on arrival are counted per
process, as the API's request counters are (app/core/middleware.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select

from app.core.db import as_aware, session_scope, utcnow
from app.core.logging import get_logger
from app.health import burnin
from app.models.fleet import Gpu, MigRelayout, Node, Rack, Region, Upgrade, UpgradeNode
from app.models.health import PLACEABLE, BurnIn, HealthIncident, HealthRepair, IdleIron
from app.models.workloads import (
    CYCLE_BUCKETS,
    GpuUsage,
    PlacementCycleStats,
    Workload,
    cycle_bucket_column,
)
from app.scheduling.lifecycle import State

log = get_logger(__name__)
DURATION_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600)
WAIT_BUCKETS = (1, 5, 15, 30, 60, 300, 900, 3600, 4 * 3600)
TELEMETRY_REJECTED = Counter(
    "rackplane_telemetry_rejected_samples",
    "Telemetry samples rejected on arrival (never acted on), by reason (app/health/telemetry.py)",
    ["reason"],
)


def _histogram(name: str, doc: str, label: str, rows: dict[str, list[float]], buckets) -> Any:
    h = HistogramMetricFamily(name, doc, labels=[label])
    for key, values in sorted(rows.items()):
        counts = []
        for b in buckets:
            counts.append((str(float(b)), sum(v <= b for v in values)))
        counts.append(("+Inf", len(values)))
        h.add_metric([key], counts, sum(values))
    return h


class FleetCollector(Collector):
    def describe(self) -> list:
        # Without this, registering calls collect() (a database read at import time).
        return []

    def collect(self) -> Iterator:
        try:
            yield from self._collect()
        except Exception as exc:  # a scrape must not fail the API's own metrics
            log.warning("fleet_metrics_failed", error=str(exc)[:300])

    def _collect(self) -> Iterator:
        with session_scope() as s:
            yield from _gpus(s)
            yield _idle_iron(s)
            yield from _incidents(s)
            yield from _repairs(s)
            yield from _burn_ins(s)
            yield from _lifecycle(s)
            yield from _lost_work(s)
            yield _cycles(s)
            yield _queue_waits(s)


def _gpus(s: Any) -> Iterator:
    """GPUs by health state (a GPU's node's when the node is out) and by allocation."""
    placeable = [h.value for h in PLACEABLE]
    effective = case((Node.health.in_(placeable), Gpu.health), else_=Node.health)
    usable = (Node.state == "ready") & Node.health.in_(placeable) & Gpu.health.in_(placeable)
    used = func.coalesce(GpuUsage.milli_used, 0) > 0
    alloc = case((used, "allocated"), (usable, "idle"), else_="unavailable")
    rows = s.execute(
        select(Region.name, Gpu.model, effective, alloc, func.count())
        .select_from(Gpu)
        .join(Node, Gpu.node_id == Node.id)
        .join(Rack, Node.rack_id == Rack.id)
        .join(Region, Rack.region_id == Region.id)
        .outerjoin(
            GpuUsage,
            (GpuUsage.node_id == Gpu.node_id) & (GpuUsage.gpu_index == Gpu.index),
        )
        .where(Node.state != "retired")
        .group_by(Region.name, Gpu.model, effective, alloc)
    ).all()
    by_health = GaugeMetricFamily(
        "rackplane_gpus", "GPUs by health state", labels=["region", "model", "health"]
    )
    by_alloc = GaugeMetricFamily(
        "rackplane_gpus_allocation",
        "GPUs allocated, idle (ready, nothing on them) or unavailable (out of the pool)",
        labels=["region", "model", "state"],
    )
    health_n: dict[tuple, int] = {}
    alloc_n: dict[tuple, int] = {}
    for region, model, health, a, n in rows:
        health_n[(region, model, health)] = health_n.get((region, model, health), 0) + n
        alloc_n[(region, model, a)] = alloc_n.get((region, model, a), 0) + n
    for k, n in sorted(health_n.items()):
        by_health.add_metric(list(k), n)
    for k, n in sorted(alloc_n.items()):
        by_alloc.add_metric(list(k), n)
    yield by_health
    yield by_alloc


def _idle_iron(s: Any) -> CounterMetricFamily:
    idle = CounterMetricFamily(
        "rackplane_idle_gpu_seconds",
        "Idle iron: GPU-seconds ready, healthy GPUs spent with nothing on them",
        labels=["region", "model"],
    )
    for r in s.scalars(select(IdleIron).order_by(IdleIron.region, IdleIron.gpu_model)):
        idle.add_metric([r.region, r.gpu_model], r.gpu_seconds)
    return idle


def _incidents(s: Any) -> Iterator:
    """Fault incidents by class, and those the circuit breaker held back."""
    faults = CounterMetricFamily(
        "rackplane_health_incidents",
        "Fault incidents (bursts) by their class: the Xid (or signal) and the action",
        labels=["signal", "xid", "action"],
    )
    for signal, code, action, n in s.execute(
        select(
            HealthIncident.signal, HealthIncident.code, HealthIncident.action, func.count()
        ).group_by(HealthIncident.signal, HealthIncident.code, HealthIncident.action)
    ):
        xid = str(code) if signal == "xid" and code is not None else ""
        faults.add_metric([signal, xid, action], n)
    yield faults
    held = s.scalar(select(func.count()).where(HealthIncident.held_back.is_not(None)))
    c = CounterMetricFamily(
        "rackplane_health_breaker_held",
        "Incidents whose quarantine the circuit breaker held back",
    )
    c.add_metric([], held or 0)
    yield c


def _burn_ins(s: Any) -> Iterator:
    """Bring-up: nodes burning in now (by why), time to production (registered to first
    passed burn-in, nodes that reached it in the last 30 days), and GPU-hours spent in
    burn-ins (last 30 days, by outcome)."""
    now = utcnow()
    running = GaugeMetricFamily(
        "rackplane_burn_in_nodes",
        "Nodes burning in now (out of service until their suite passes), by why",
        labels=["reason"],
    )
    counts: dict[str, int] = {}
    for reason, n in s.execute(
        select(BurnIn.reason, func.count())
        .where(BurnIn.status == "running")
        .group_by(BurnIn.reason)
    ):
        counts[reason] = n
    for reason in ("bring-up", "repair", "return", "upgrade"):
        running.add_metric([reason], counts.get(reason, 0))
    yield running
    since = now - timedelta(days=30)
    ttp: list[float] = [
        (as_aware(done) - as_aware(created)).total_seconds()
        for created, done in s.execute(
            select(Node.created_at, Node.production_at).where(Node.production_at >= since)
        )
    ]
    yield _histogram(
        "rackplane_time_to_production_seconds",
        "Nodes in production within the last 30 days: registered to first passed burn-in",
        "fleet",
        {"all": ttp},
        DURATION_BUCKETS,
    )
    hours = CounterMetricFamily(
        "rackplane_burn_in_gpu_hours",
        "GPU-hours out of service in burn-ins that ended in the last 30 days, by outcome",
        labels=["outcome"],
    )
    spent: dict[str, float] = {}
    for status, gpus, started, finished in s.execute(
        select(BurnIn.status, BurnIn.gpus, BurnIn.started_at, BurnIn.finished_at).where(
            BurnIn.finished_at >= since
        )
    ):
        secs = (as_aware(finished) - as_aware(started)).total_seconds()
        spent[status] = spent.get(status, 0.0) + gpus * secs / 3600
    for status in ("passed", "failed", "rma", "withdrawn"):
        hours.add_metric([status], round(spent.get(status, 0.0), 4))
    yield hours
    stuck = GaugeMetricFamily(
        "rackplane_bring_up_stuck_nodes",
        "Nodes on their way into service that are not moving (why: GET /v1/admin/bring-up)",
    )
    stuck.add_metric([], burnin.bring_up(s, now).stuck)
    yield stuck


def _lifecycle(s: Any) -> Iterator:
    """Rolling upgrades' nodes by phase (upgrades not finished), and MIG layouts asked of
    agents in the last day by outcome."""
    phases = GaugeMetricFamily(
        "rackplane_upgrade_nodes",
        "Nodes of upgrades still running, paused or rolling back, by phase",
        labels=["phase"],
    )
    counts = dict(
        s.execute(
            select(UpgradeNode.phase, func.count())
            .join(Upgrade, Upgrade.id == UpgradeNode.upgrade_id)
            .where(Upgrade.state.in_(("running", "paused", "rolling_back")))
            .group_by(UpgradeNode.phase)
        ).all()
    )
    for phase in ("pending", "draining", "applying", "done", "failed", "skipped", "rolled_back"):
        phases.add_metric([phase], counts.get(phase, 0))
    yield phases
    layouts = GaugeMetricFamily(
        "rackplane_mig_relayouts",
        "MIG layouts asked of node agents in the last 24 hours, by status and by whom",
        labels=["status", "reason"],
    )
    since = utcnow() - timedelta(days=1)
    for status, reason, n in s.execute(
        select(MigRelayout.status, MigRelayout.reason, func.count())
        .where(MigRelayout.requested_at >= since)
        .group_by(MigRelayout.status, MigRelayout.reason)
    ):
        layouts.add_metric([status, reason], n)
    yield layouts


def _repairs(s: Any) -> Iterator:
    """Repair durations (provider's repair + validation), and how long hardware was out: from
    its incident's start to its return."""
    since = utcnow() - timedelta(days=30)
    repairs: dict[str, list[float]] = {}
    outs: dict[str, list[float]] = {}
    for kind, started, finished, opened in s.execute(
        select(
            HealthRepair.kind,
            HealthRepair.started_at,
            HealthRepair.finished_at,
            HealthIncident.opened_at,
        )
        .outerjoin(HealthIncident, HealthIncident.id == HealthRepair.incident_id)
        .where(HealthRepair.outcome == "ok", HealthRepair.finished_at >= since)
    ):
        done = as_aware(finished)
        repairs.setdefault(kind, []).append((done - as_aware(started)).total_seconds())
        if opened is not None:
            outs.setdefault(kind, []).append((done - as_aware(opened)).total_seconds())
    yield _histogram(
        "rackplane_health_repair_seconds",
        "Successful repairs (last 30 days): the provider's reset or reboot and validation",
        "kind",
        repairs,
        DURATION_BUCKETS,
    )
    yield _histogram(
        "rackplane_health_quarantine_seconds",
        "Hardware out of service for a fault (last 30 days): incident to return",
        "kind",
        outs,
        DURATION_BUCKETS,
    )


def _lost_work(s: Any) -> Iterator:
    """What faults cost the work."""
    lost, interrupted = s.execute(
        select(
            func.coalesce(func.sum(Workload.lost_work_gpu_s), 0.0),
            func.coalesce(func.sum(Workload.interruptions), 0),
        )
    ).one()
    c = CounterMetricFamily(
        "rackplane_lost_work_gpu_seconds",
        "Work lost to hardware faults: GPUs x seconds since each stopped workload's last "
        "checkpoint",
    )
    c.add_metric([], float(lost))
    yield c
    c = CounterMetricFamily(
        "rackplane_workload_interruptions", "Workloads stopped by hardware faults"
    )
    c.add_metric([], int(interrupted))
    yield c


def _queue_waits(s: Any) -> HistogramMetricFamily:
    """How long the workloads waiting now have waited."""
    now = utcnow()
    waits: dict[str, list[float]] = {}
    for priority, created in s.execute(
        select(Workload.priority, Workload.created_at).where(Workload.state == State.queued.value)
    ):
        waits.setdefault(priority, []).append((now - as_aware(created)).total_seconds())
    return _histogram(
        "rackplane_queue_wait_seconds",
        "How long the workloads waiting now have waited, by priority",
        "priority",
        waits,
        WAIT_BUCKETS,
    )


def _cycles(s: Any) -> HistogramMetricFamily:
    h = HistogramMetricFamily(
        "rackplane_placement_cycle_seconds",
        "Placement cycles by region: how long deciding and applying a plan took",
        labels=["region"],
    )
    for r in s.scalars(select(PlacementCycleStats).order_by(PlacementCycleStats.region)):
        buckets = [(str(b), getattr(r, cycle_bucket_column(b))) for b in CYCLE_BUCKETS]
        h.add_metric([r.region], [*buckets, ("+Inf", r.cycles)], r.seconds_sum)
    return h


_REGISTERED = False


def register() -> None:
    """Add the collector to the default registry once (the API's /metrics serves it)."""
    global _REGISTERED
    if _REGISTERED:
        return
    REGISTRY.register(FleetCollector())
    _REGISTERED = True
