"""Scenario and property tests of the queueing core: one rule per test, small builders."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.placement.isolation import Tier
from app.placement.model import Request, Shape
from app.placement.queueing import (
    BASELINES,
    QueueConfig,
    Scheduler,
    TenantQuota,
    UsageHistory,
    Workload,
)
from tests.fixtures.snapshots import assert_same_state, node, snap

pytestmark = pytest.mark.no_db

H100 = "H100-80GB"
GPU = 1000  # one GPU-equivalent in milli


def quota(guaranteed: float = 0, limit: float | None = None, weight: float = 1.0, model=H100):
    return TenantQuota(
        guaranteed={model: int(guaranteed * GPU)},
        limit={} if limit is None else {model: int(limit * GPU)},
        weight=weight,
    )


class Queue:
    """A tiny worker: keeps pending and running workloads and applies each cycle's decisions."""

    def __init__(self, nodes, tenants, config: QueueConfig | None = None, **kw):
        self.snap = snap(*nodes)
        self.sched = Scheduler(self.snap, tenants, config or QueueConfig(**kw))
        self.pending: dict[str, Workload] = {}
        self.running: dict[str, Workload] = {}
        self.last = None

    def submit(
        self,
        wid: str,
        tenant: str,
        gpus: int = 1,
        *,
        at: float = 0.0,
        prio: str = "training",
        runtime: float = 3600.0,
        replicas: int = 1,
        ckpt_cost: float = 0.0,
        shape: Shape | None = None,
        tier: Tier = Tier.DEDICATED,
    ) -> Workload:
        req = Request(wid, tenant, tier, shape or Shape(gpus=gpus), replicas=replicas)
        w = Workload(wid, req, prio, at, runtime, checkpoint_cost=ckpt_cost)
        self.pending[wid] = w
        return w

    def cycle(self, now: float):
        res = self.sched.cycle(now, list(self.pending.values()), list(self.running.values()))
        self.snap.commit()
        for ev in res.evictions:
            w = self.running.pop(ev.workload)
            w.started_at, w.alloc_ids, w.preempted_at = None, (), now
            self.pending[w.id] = w
        for adm in res.admissions:
            w = self.pending.pop(adm.workload)
            w.alloc_ids = tuple(b.alloc_id for b in adm.bindings)
            w.started_at = adm.start_at
            self.running[w.id] = w
        self.last = res
        return res

    def finish(self, wid: str) -> None:
        w = self.running.pop(wid)
        for aid in w.alloc_ids:
            self.snap.release(aid)
        self.snap.commit()

    def admitted(self) -> set[str]:
        return {a.workload for a in self.last.admissions}

    def evicted(self) -> set[str]:
        return {e.workload for e in self.last.evictions}

    def used(self, tenant: str) -> int:
        return sum(w.gpu_milli for w in self.running.values() if w.tenant == tenant)


# --- quotas, borrowing and reclaim ----------------------------------------------------------------


def test_idle_capacity_is_borrowed_up_to_the_limit_and_marked_borrowed():
    q = Queue([node("n1")], {"a": quota(4, limit=6), "b": quota(4)})
    for i in range(8):
        q.submit(f"a{i}", "a", at=i)
    res = q.cycle(10)
    assert q.admitted() == {f"a{i}" for i in range(6)}  # the limit, not the fleet
    assert [a.borrowed for a in res.admissions] == [False] * 4 + [True] * 2
    assert res.blocked["a6"] == "over its tenant's limit"


def test_reclaim_takes_back_borrowed_capacity_but_never_below_the_lenders_guarantee():
    q = Queue([node("n1")], {"a": quota(4), "b": quota(4)})
    for i in range(8):
        q.submit(f"b{i}", "b", at=i)
    q.cycle(10)
    assert q.used("b") == 8 * GPU
    for i in range(6):
        q.submit(f"a{i}", "a", at=2000 + i)
    res = q.cycle(2000)
    # a may reclaim up to its guarantee (4); b keeps its own 4.
    assert len(res.evictions) == 4 and {e.reason for e in res.evictions} == {"reclaim"}
    assert q.used("b") == 4 * GPU and q.used("a") == 4 * GPU
    assert all(a.phase == "reclaim" and not a.borrowed for a in res.admissions)


def test_work_within_guarantee_is_not_reclaimed():
    q = Queue([node("n1", gpus=4)], {"a": quota(2), "b": quota(2)})
    for i in range(2):
        q.submit(f"b{i}", "b")
    q.cycle(0)
    for i in range(4):
        q.submit(f"a{i}", "a", at=1000)
    q.cycle(1000)
    assert len(q.running) == 4 and q.evicted() == set()
    # The next a beyond its guarantee waits instead of reclaiming.
    q.submit("a9", "a", at=1001)
    q.cycle(2000)
    assert q.evicted() == set() and "a9" in q.pending


def test_quota_counts_mig_slices_and_shares_in_gpu_equivalents():
    mig_nodes = [node("n1", 8, "A100-80GB", mig=tuple(range(8)))]
    tenants = {"a": quota(0, limit=1, model="A100-80GB")}
    q = Queue(mig_nodes, tenants)
    for i in range(9):
        q.submit(f"s{i}", "a", shape=Shape(mig="1g"), tier=Tier.MIG_SHARED, at=i)
    q.cycle(10)
    assert len(q.running) == 8  # 8 x 1g = 8 x 125 milli = one GPU-equivalent
    assert q.last.blocked["s8"] == "over its tenant's limit"

    q2 = Queue([node("n1", 8, "A100-80GB")], tenants)
    for i in range(5):
        q2.submit(f"f{i}", "a", shape=Shape(milli=250, gpu_mem_mib=1024), tier=Tier.MPS, at=i)
    q2.cycle(10)
    assert len(q2.running) == 4  # 4 x 250 milli


# --- fair share ----------------------------------------------------------------------------------


def test_fair_share_serves_the_tenant_that_used_less_and_history_decays():
    tenants = {"a": quota(), "b": quota()}

    def history(half_life: float) -> UsageHistory:
        h = UsageHistory(half_life)
        h.advance(0, {})
        h.advance(3600, {("a", H100): 8 * GPU})  # a used 8 GPUs for the first hour
        h.advance(36_000, {})
        h.advance(39_600, {("b", H100): 1 * GPU})  # b used 1 GPU for the last hour
        return h

    for half_life, first in ((3600, "a1"), (3600 * 1000, "b1")):
        q = Queue([node("n1", gpus=1)], tenants)
        q.sched.history = history(half_life)
        q.submit("a1", "a", at=39_000, runtime=10**6)
        q.submit("b1", "b", at=39_000, runtime=10**6)
        q.cycle(39_600)
        # A short half-life forgets a's old burst; a long one still holds it against a.
        assert q.admitted() == {first}, half_life


def test_fair_share_weights_split_a_burst_of_capacity():
    q = Queue([node("n1")], {"a": quota(weight=3), "b": quota(weight=1)}, history_weight=0)
    for i in range(8):
        q.submit(f"a{i}", "a", at=i)
        q.submit(f"b{i}", "b", at=i)
    q.cycle(100)
    assert q.used("a") == 6 * GPU and q.used("b") == 2 * GPU


def test_priority_goes_before_fair_share():
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()})
    q.submit("b-research", "b", prio="research", at=0)
    q.submit("a-prod", "a", prio="production", at=50)
    q.cycle(60)
    assert q.admitted() == {"a-prod"}


def test_priority_can_be_scoped_to_the_tenant():
    """priority_across_tenants=False: priority orders a tenant's own work; across tenants the
    fair share decides, and a higher class evicts another tenant only if that tenant stays
    better off than the taker."""
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, priority_across_tenants=False)
    q.submit("b-research", "b", prio="research", at=0)
    q.submit("a-prod", "a", prio="production", at=50)
    q.cycle(60)
    assert q.admitted() == {"b-research"}

    q = Queue([node("n1", gpus=2)], {"a": quota(), "b": quota()}, priority_across_tenants=False)
    _running(q, "a-old", "a", prio="research", started=0, ckpt=900)
    _running(q, "b-old", "b", prio="research", started=0, ckpt=0)  # the cheaper victim
    q.submit("a-prod", "a", prio="production", at=1000)
    res = q.cycle(1000)
    assert [e.workload for e in res.evictions] == ["a-old"]  # b would end below a
    assert q.admitted() == {"a-prod"}


def _over_served(guaranteed: float = 0, **kw) -> Queue:
    """Two 4-GPU nodes. a holds n1 with four 1-GPU jobs and has three short ones waiting; b
    holds one GPU of n2 and waits with a 4-GPU job that the 3 free GPUs cannot take."""
    q = Queue(
        [node("n1", gpus=4), node("n2", gpus=4)],
        {"a": quota(guaranteed), "b": quota()},
        history_weight=0,
        **kw,
    )
    for i in range(4):
        q.submit(f"a-run{i}", "a", at=0)
    q.cycle(0)
    q.submit("b-run", "b", at=1)
    q.cycle(1)
    assert set(q.running) == {"a-run0", "a-run1", "a-run2", "a-run3", "b-run"}
    q.submit("b-four", "b", 4, at=5)
    for i in range(3):
        q.submit(f"a-short{i}", "a", at=5, runtime=60)
    return q


def test_share_cap_holds_a_tenant_to_its_fair_share_while_others_wait():
    """Work-conserving by default: a's short jobs take the GPUs b's gang cannot use yet. With
    share_cap=1, a already holds its fair share (4 of 8: equal weights, both waiting) and
    starts nothing more while b waits."""
    q = _over_served()
    q.cycle(10)
    assert q.admitted() == {"a-short0", "a-short1", "a-short2"}

    q = _over_served(share_cap=1.0)
    res = q.cycle(10)
    assert q.admitted() == set()
    assert res.blocked["a-short0"] == "at its fair share while other tenants wait"
    q.finish("b-run")
    q.cycle(20)
    assert q.admitted() == {"b-four"}  # and a, now alone in the queue, is not held back
    q.cycle(30)
    assert q.admitted() == set()  # b-four holds n2: no room
    q.finish("a-run0")
    q.cycle(40)
    assert q.admitted() == {"a-short0"}


def test_share_cap_never_holds_a_tenant_below_its_guarantee_nor_starves_it():
    q = _over_served(guaranteed=6, share_cap=1.0)
    q.cycle(10)
    assert len(q.admitted()) == 2  # up to its guarantee of 6, beyond its fair share of 4

    q = _over_served(share_cap=1.0)
    q.cycle(10)
    q.finish("a-run0")
    q.cycle(20)  # below its share, a starts again, one workload at a time
    assert len(q.admitted()) == 1 and q.used("a") == 4 * GPU
    with pytest.raises(ValueError, match="share_cap"):
        Scheduler(snap(node("n1")), {}, QueueConfig(share_cap=0.5))


# --- preemption -----------------------------------------------------------------------------------


def _running(q: Queue, wid: str, tenant: str, *, prio: str, started: float, ckpt: float, **kw):
    w = q.submit(wid, tenant, prio=prio, at=started, **kw)
    q.cycle(started)
    assert wid in q.running
    w.last_checkpoint_at = ckpt
    return w


def test_preemption_evicts_the_victim_that_loses_the_least_work():
    q = Queue([node("n1", gpus=3)], {"a": quota(), "b": quota()})
    _running(q, "old-ckpt", "b", prio="research", started=0, ckpt=100)
    _running(q, "new-ckpt", "b", prio="research", started=0, ckpt=3500)
    _running(q, "two-gpu", "b", prio="research", started=0, ckpt=3000)
    q.submit("prod", "a", prio="production", at=3600)
    res = q.cycle(3600)
    assert q.evicted() == {"new-ckpt"}
    [ev] = res.evictions
    assert ev.reason == "priority" and ev.by == "prod"
    assert ev.deadline == 3600 + q.sched.config.grace_period
    [adm] = res.admissions
    assert adm.start_at == ev.deadline and adm.victims == ("new-ckpt",)


def test_lost_work_counts_gpus_times_checkpoint_age():
    q = Queue([node("n1", gpus=3)], {"a": quota(), "b": quota()}, grace_period=0, checkpoint_wait=0)
    _running(q, "wide", "b", prio="research", started=0, ckpt=3000, gpus=2, ckpt_cost=60)
    _running(q, "narrow", "b", prio="research", started=0, ckpt=2500, ckpt_cost=60)
    q.submit("prod", "a", prio="production", at=3600)
    res = q.cycle(3600)
    # wide loses 2 x 600 = 1200 GPU-s, narrow 1 x 1100: narrow goes.
    assert q.evicted() == {"narrow"}
    assert res.evictions[0].lost_gpu_seconds == pytest.approx(1100)


def test_grace_period_lets_a_cheap_checkpoint_save_the_work():
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, grace_period=120)
    _running(q, "v", "b", prio="research", started=0, ckpt=0, ckpt_cost=60)
    q.submit("prod", "a", prio="production", at=3600)
    res = q.cycle(3600)
    assert res.evictions[0].lost_gpu_seconds == 0  # checkpoints within the grace period


def test_a_victim_may_finish_a_checkpoint_that_outlasts_the_grace_period():
    """Up to `checkpoint_wait`, the eviction waits for the victim's checkpoint (nothing lost)
    and the preemptor starts when it is written; beyond it, the grace period holds."""
    for cost, stops, lost in ((200, 3800, 0.0), (400, 3720, 3600.0)):
        q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, checkpoint_wait=300)
        _running(q, "v", "b", prio="research", started=0, ckpt=0, ckpt_cost=cost)
        q.submit("prod", "a", prio="production", at=3600)
        res = q.cycle(3600)
        [ev] = res.evictions
        assert (ev.deadline, ev.lost_gpu_seconds) == (stops, lost), cost
        assert res.admissions[0].start_at == stops


def test_a_victim_that_can_checkpoint_in_time_is_cheaper_than_a_fresh_checkpoint():
    q = Queue([node("n1", gpus=2)], {"a": quota(), "b": quota()}, checkpoint_wait=300)
    _running(q, "stale-but-quick", "b", prio="research", started=0, ckpt=0, ckpt_cost=200)
    _running(q, "fresh-but-slow", "b", prio="research", started=0, ckpt=3500, ckpt_cost=1000)
    q.submit("prod", "a", prio="production", at=3600)
    [ev] = q.cycle(3600).evictions
    assert (ev.workload, ev.lost_gpu_seconds) == ("stale-but-quick", 0)


def test_never_preempts_a_higher_or_equal_priority_for_priority():
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()})
    _running(q, "prod", "b", prio="production", started=0, ckpt=0)
    q.submit("train", "a", prio="training", at=3600)
    q.submit("prod2", "a", prio="production", at=3600)
    q.cycle(3600)
    assert q.evicted() == set() and "prod" in q.running


def test_minimum_runtime_and_cool_down_protect_victims_but_not_preemptible_ones():
    cfg = dict(min_runtime=600, cooldown=1800)
    q = Queue([node("n1", gpus=2)], {"a": quota(), "b": quota()}, **cfg)
    _running(q, "young", "b", prio="research", started=3300, ckpt=3300)  # ran 5 minutes
    w = _running(q, "bounced", "b", prio="research", started=0, ckpt=0)
    w.preempted_at = 3000  # evicted 10 minutes ago
    q.submit("prod", "a", prio="production", at=3600)
    q.cycle(3600)
    assert q.evicted() == set()

    q2 = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, **cfg)
    _running(q2, "cheap", "b", prio="preemptible", started=3500, ckpt=3500)
    q2.submit("train", "a", prio="training", at=3600)
    q2.cycle(3600)
    assert q2.evicted() == {"cheap"}


def test_thrash_is_bounded_by_the_cool_down():
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, min_runtime=0, cooldown=1800)
    _running(q, "v", "b", prio="research", started=0, ckpt=0)
    q.submit("p1", "a", prio="production", at=100)
    q.cycle(1000)
    assert q.evicted() == {"v"}
    q.finish("p1")
    q.cycle(1200)  # v comes back
    assert "v" in q.running
    q.submit("p2", "a", prio="production", at=1300)
    q.cycle(1300)
    assert q.evicted() == set()  # evicted 300 s ago: not again yet
    q.cycle(1000 + 1800)
    assert q.evicted() == {"v"}


# --- reservations and backfill --------------------------------------------------------------------


def _reservation_world():
    """Two 8-GPU nodes: x holds n1 until t=1000, y holds 4 GPUs of n2 until t=5000."""
    q = Queue([node("n1"), node("n2")], {"a": quota(), "b": quota()})
    q.submit("x", "b", 8, runtime=1000)
    q.submit("y", "b", 4, runtime=5000)
    q.cycle(0)
    assert set(q.running) == {"x", "y"}
    q.submit("gang", "a", 8, replicas=2, at=10, runtime=3600)
    return q


def test_a_blocked_gang_gets_a_reservation_from_declared_runtimes():
    q = _reservation_world()
    res = q.cycle(10)
    [r] = res.reservations
    assert r.workload == "gang" and r.start_at == 5000
    assert len(r.gpus) == 16


def test_backfill_only_admits_work_that_cannot_delay_the_reservation():
    q = _reservation_world()
    q.submit("long", "b", 4, at=11, runtime=10_000)  # would hold n2 past t=5000
    q.submit("short", "b", 4, at=12, runtime=3000)  # ends at 3010 < 5000
    res = q.cycle(20)
    assert q.admitted() == {"short"}
    assert {a.phase for a in res.admissions} == {"backfill"}
    assert res.blocked["long"] == "no capacity"


def test_backfill_uses_capacity_outside_the_reservation():
    q = Queue([node("n1"), node("n2"), node("n3")], {"a": quota(), "b": quota()})
    q.submit("x", "b", 8, runtime=1000)
    q.submit("y", "b", 4, runtime=5000)
    q.cycle(0)
    q.submit("gang", "a", 8, replicas=2, at=10, runtime=3600)
    q.submit("small", "b", 2, at=11, runtime=100_000)
    q.cycle(20)
    [r] = q.last.reservations

    def node_of(wid):
        [aid] = q.running[wid].alloc_ids
        return q.snap.node_names[q.snap.allocs[aid].node]

    held = {n for n, _ in r.gpus}
    assert r.start_at == 1000 and len(r.gpus) == 16 and node_of("y") not in held
    assert "small" in q.running  # long, but beside y, outside the reservation
    assert node_of("small") == node_of("y")


def test_the_reserved_gang_starts_no_later_than_its_reservation():
    q = _reservation_world()
    first = q.cycle(10).reservations[0].start_at
    t, i = 10.0, 0
    while "gang" not in q.running:
        t += 500
        i += 1
        q.submit(f"filler{i}", "b", 1, at=t, runtime=2000)  # a stream of small work
        for wid in [w for w, v in q.running.items() if v.started_at + v.max_runtime <= t]:
            q.finish(wid)
        q.cycle(t)
        assert t <= first + 500, "the gang was pushed back past its reservation"


def test_a_reservation_stays_on_its_gpus_while_its_workload_waits():
    """Recomputed every cycle, a reservation drifts: here an urgent job would take n1 and push
    the gang from t=3000 (n1 + n3) to t=5000 (n3 + n2). Carried over, it holds."""
    q = Queue([node("n1"), node("n2"), node("n3")], {"a": quota(), "b": quota()})
    q.submit("x", "b", 8, runtime=1000)  # n1 until 1000
    q.submit("y", "b", 6, runtime=5000)
    q.submit("z", "b", 6, runtime=3000)
    q.cycle(0)
    q.submit("gang", "a", 8, replicas=2, at=10, runtime=3600)
    [first] = q.cycle(10).reservations
    assert first.start_at == 3000
    q.finish("x")
    q.submit("urgent", "b", 8, at=15, prio="production", runtime=100_000)
    [again] = q.cycle(20).reservations
    assert again.gpus == first.gpus and again.start_at == 3000
    assert "urgent" not in q.running


def test_starving_work_goes_first_even_before_higher_priorities():
    """Aging bounds every wait: work that has waited its declared runtime goes ahead of fresh
    work of any class (and then gets the reservation if it does not fit)."""
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, starvation_factor=1.0)
    q.sched.history.advance(0, {})
    q.sched.history.advance(3600, {("a", H100): 8 * GPU})
    q.submit("a-starved", "a", at=0, runtime=600, prio="research")  # waited 6x its runtime
    q.submit("b-fresh", "b", at=3500, runtime=600, prio="production")
    q.cycle(3600)
    assert q.admitted() == {"a-starved"}


def test_a_reservation_that_comes_due_starts_even_behind_a_blocked_head():
    """The walk stops at a blocked production gang and backfill looks no further, yet the
    workload whose reserved GPUs are now free starts on them."""
    q = Queue([node("n1"), node("n2")], {"a": quota(), "b": quota(), "c": quota()})
    q.submit("x", "b", 8, runtime=1000)
    q.submit("y", "b", 4, runtime=100_000, prio="production")
    q.cycle(0)
    q.submit("big", "a", 8, at=10)
    [r] = q.cycle(10).reservations
    assert r.workload == "big" and r.start_at == 1000
    q.finish("x")
    q.sched.config = replace(q.sched.config, backfill_depth=0)
    q.submit("huge", "c", 8, replicas=2, at=900, prio="production")
    q.cycle(1000)
    assert q.admitted() == {"big"}
    assert {q.snap.node_names[q.snap.allocs[a].node] for a in q.running["big"].alloc_ids} == {
        n for n, _ in r.gpus
    }


# --- defragmentation ------------------------------------------------------------------------------


def _scattered(prio: str = "training", **kw) -> Queue:
    """Two 8-GPU nodes, each with one small job: 14 GPUs free, no node free for 8."""
    q = Queue([node("n1"), node("n2")], {"a": quota(), "b": quota()}, **kw)
    _running(q, "fill", "b", prio=prio, started=0, ckpt=0, gpus=7)
    _running(q, "s1", "b", prio=prio, started=0, ckpt=0, ckpt_cost=200)  # beside fill
    _running(q, "s2", "b", prio=prio, started=0, ckpt=0, ckpt_cost=50, gpus=2)
    q.finish("fill")
    assert len({q.snap.allocs[q.running[w].alloc_ids[0]].node for w in ("s1", "s2")}) == 2
    return q


def test_defragment_moves_small_work_so_whole_node_work_starts():
    q = _scattered()
    q.submit("node", "a", 8, at=3000)
    res = q.cycle(3600)
    # A move costs its checkpoint's GPU-seconds: s2 (2 x 50) is cheaper than s1 (1 x 200).
    [ev] = res.evictions
    assert (ev.workload, ev.reason, ev.by) == ("s2", "defragment", "node")
    assert ev.deadline == 3600 + q.sched.config.grace_period and ev.lost_gpu_seconds == 0
    [adm] = res.admissions
    assert adm.phase == "defragment" and adm.start_at == ev.deadline
    # The moved work fits beside s1 when it is queued again.
    q.cycle(ev.deadline)
    assert "s2" in q.running
    nodes = {w: q.snap.allocs[q.running[w].alloc_ids[0]].node for w in ("s1", "s2", "node")}
    assert nodes["s1"] == nodes["s2"] != nodes["node"]


def test_defragment_moves_only_work_that_checkpoints_within_the_wait():
    q = _scattered(checkpoint_wait=300)
    q.running["s2"].checkpoint_cost = 1000  # would lose work (or hold the node idle) if moved
    q.submit("node", "a", 8, at=3000)
    res = q.cycle(3600)
    [moved] = res.evictions  # s1 (200 s) instead, waiting for its checkpoint past the grace
    assert (moved.workload, moved.deadline, moved.lost_gpu_seconds) == ("s1", 3800, 0)
    assert res.admissions[0].start_at == 3800
    q = _scattered(checkpoint_wait=300)
    for w in ("s1", "s2"):
        q.running[w].checkpoint_cost = 1000
    q.submit("node", "a", 8, at=3000)
    assert q.cycle(3600).evictions == []


def test_defragment_never_moves_higher_priority_or_protected_work():
    q = _scattered(prio="production")
    q.submit("node", "a", 8, at=3000)
    assert q.cycle(3600).evictions == []
    q = _scattered(min_runtime=7200)
    q.submit("node", "a", 8, at=3000)
    assert q.cycle(3600).evictions == []


def test_defragment_moves_nothing_that_cannot_land_elsewhere():
    q = Queue([node("n1"), node("n2")], {"a": quota(), "b": quota()})
    _running(q, "w1", "b", prio="training", started=0, ckpt=0, gpus=5)
    _running(q, "w2", "b", prio="training", started=0, ckpt=0, gpus=5)
    q.submit("node", "a", 8, at=3000)
    res = q.cycle(3600)  # 3 + 3 free: a 5-GPU job has nowhere to go
    assert res.evictions == [] and q.admitted() == set()
    q = _scattered(defragment_per_cycle=0)
    q.submit("node", "a", 8, at=3000)
    assert q.cycle(3600).evictions == []  # switched off


# --- what-if ----------------------------------------------------------------------------------


def test_what_if_answers_without_changing_anything():
    q = _reservation_world()
    before = q.snap.state()
    gang = q.pending["gang"]
    ans = q.sched.what_if(gang, 10, list(q.pending.values()), list(q.running.values()))
    assert not ans.placeable_now and ans.expected_start == 5000
    small = Workload("s", Request("s", "a", Tier.DEDICATED, Shape(gpus=2)), "training", 10, 60)
    ans = q.sched.what_if(small, 10, list(q.pending.values()), list(q.running.values()))
    assert ans.placeable_now and ans.preempts == () and len(ans.bindings) == 1
    prod = Workload("p", Request("p", "a", Tier.DEDICATED, Shape(gpus=8)), "production", 10, 60)
    ans = q.sched.what_if(prod, 10_000, list(q.pending.values()), list(q.running.values()))
    assert ans.placeable_now and set(ans.preempts) <= {"x", "y"} and ans.preempts
    assert_same_state(before, q.snap.state())


# --- configuration ----------------------------------------------------------------------------


def test_phases_are_configuration():
    with pytest.raises(ValueError, match="unknown phases"):
        Scheduler(snap(node("n1")), {}, QueueConfig(phases=("allocate", "teleport")))
    with pytest.raises(ValueError, match="defragment_max_moved"):
        Scheduler(snap(node("n1")), {}, QueueConfig(defragment_max_moved=1.0))
    q = Queue([node("n1", gpus=1)], {"a": quota(), "b": quota()}, phases=("allocate",))
    _running(q, "low", "b", prio="preemptible", started=0, ckpt=0)
    q.submit("prod", "a", prio="production", at=10)
    q.cycle(3600)
    assert q.evicted() == set()  # no preempt phase configured


def test_fifo_baseline_skips_what_does_not_fit_and_priority_baseline_stops():
    for name, expect in (("fifo", {"small"}), ("priority", set())):
        q = Queue([node("n1", gpus=4)], {"a": quota()}, BASELINES[name])
        q.submit("big", "a", 8, at=0)
        q.submit("small", "a", 1, at=1)
        q.cycle(10)
        assert q.admitted() == expect, name


# --- properties ---------------------------------------------------------------------------------

PRIOS = ["production", "training", "research", "preemptible"]

workload_st = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from(PRIOS),
    st.integers(0, 5000),  # submitted / started at
    st.integers(0, 3),  # replicas - 1 for gangs of 8
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    running=st.lists(workload_st, max_size=10),
    pending=st.lists(workload_st, min_size=1, max_size=12),
    limits=st.tuples(*[st.sampled_from([None, 4, 8, 16]) for _ in range(3)]),
    guarantees=st.tuples(*[st.sampled_from([0, 4, 8]) for _ in range(3)]),
)
def test_a_cycle_never_exceeds_limits_nor_preempts_upwards(running, pending, limits, guarantees):
    tenants = {t: quota(g, limit=lim) for t, g, lim in zip("abc", guarantees, limits, strict=True)}
    q = Queue([node(f"n{i}") for i in range(3)], tenants, min_runtime=0, cooldown=0)
    # Start the running set under no limits, then apply the real ones.
    q.sched.tenants = {t: replace(v, limit={}) for t, v in tenants.items()}
    for i, (t, g, p, at, _) in enumerate(running):
        q.submit(f"r{i}", t, g, prio=p, at=at)
    q.cycle(0)
    for w in q.running.values():
        w.started_at = 0
    q.sched.tenants = tenants
    before = {t: q.used(t) for t in tenants}
    prio = {w.id: q.sched.prio(w).value for w in [*q.running.values(), *q.pending.values()]}
    for i, (t, g, p, at, rep) in enumerate(pending):
        gpus, reps = (8, rep + 1) if rep else (g, 1)
        w = q.submit(f"p{i}", t, gpus, prio=p, at=6000 + at, replicas=reps)
        prio[w.id] = q.sched.prio(w).value
    res = q.cycle(20_000)
    for t, quota_ in tenants.items():
        cap = quota_.cap(H100)
        if cap is not None:
            assert q.used(t) <= max(cap, before[t])
    for ev in res.evictions:
        assert prio[ev.workload] <= prio[ev.by]
        if ev.reason == "priority":
            assert prio[ev.workload] < prio[ev.by] or prio[ev.workload] == 0
    # Nothing is double-booked: every GPU has at most one whole-GPU holder.
    held = [
        (q.snap.allocs[aid].node, s)
        for w in q.running.values()
        for aid in w.alloc_ids
        for s in q.snap.allocs[aid].slots
    ]
    assert len(held) == len(set(held))


def test_work_only_some_nodes_may_run_failing_blocks_nothing_any_node_may_run():
    """A whole-GPU shape that failed is skipped for the rest of the walk; its software (here a
    runtime only one node offers) is part of the shape, so a blocked `podman` job does not
    make a `process` job of the same size "known to fail" while a node for it is free."""
    q = Queue(
        [
            replace(node("ctr", 8), runtimes=frozenset({"podman"})),
            replace(node("proc", 8), runtimes=frozenset({"process"})),
        ],
        {"a": quota(16)},
    )
    q.submit("holder", "a", 8)
    q.pending["holder"].request = replace(q.pending["holder"].request, runtime="podman")
    q.cycle(0.0)
    assert q.admitted() == {"holder"}
    for wid, runtime, at in (("ctr-2", "podman", 1.0), ("proc-1", "process", 2.0)):
        q.submit(wid, "a", 8, at=at)
        q.pending[wid].request = replace(q.pending[wid].request, runtime=runtime)
    q.cycle(10.0)
    assert q.admitted() == {"proc-1"}, q.last
