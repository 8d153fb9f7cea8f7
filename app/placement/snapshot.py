"""The fleet snapshot: arrays of capacity, indexes of free capacity, and an undo log.

State lives in numpy arrays indexed by node (and GPU slot on the node); indexes of *free*
capacity (nodes by whole-free GPU count, partly used shareable GPUs by free milli, MIG GPUs by
the profiles that still fit, topology groups by free GPUs) are kept in step with every change,
so a placement looks up candidates instead of scanning the fleet.

Every change goes through logged writes: `checkpoint()` marks the log, `rollback(mark)` undoes
to it (arrays restored exactly, indexes rebuilt from them for the touched nodes), `commit()`
forgets the log. Policies use this to try what-ifs without copying the fleet.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from app.placement.catalog import GPU_MODELS
from app.placement.isolation import Tier, claims_whole_node, may_share_gpu
from app.placement.mig import PROFILES, MigProfile, fitting_profiles, laid_free
from app.placement.model import Level

HEALTHY, DEGRADED, FAILED = 0, 1, 2
NO_TENANT = -1
MIXED = -2
FRACTION_TIERS = (Tier.TIMESLICE, Tier.MPS)
MIG_TIERS = (Tier.MIG_SHARED, Tier.MIG_DEDICATED)
_ARR, _DICT = 0, 1
_FRACTION_CODES = frozenset(int(t) for t in FRACTION_TIERS)


@dataclass
class NodeSpec:
    name: str
    model: str
    gpus: int
    cpu_milli: int
    mem_mib: int
    region: str = "default"
    rack: str | None = None
    block: str | None = None
    domain: str | None = None  # NVLink domain; default: the node itself
    gpu_mem_mib: int | None = None
    mig_gpus: tuple[int, ...] = ()
    schedulable: bool = True
    perf: float = 1.0  # relative speed; 1.0 nominal, lower is slower
    gpu_health: tuple[int, ...] | None = None
    gpu_perf: tuple[float, ...] | None = None  # per GPU, times `perf` (measured: app/health)
    # The software stack the node runs (driver, CUDA, NCCL, firmware... pinned together; None:
    # not declared), whether what it runs differs from that stack (drifted: no gangs), and its
    # CUDA version as CUDA encodes it (12040 for 12.4; 0: unknown).
    stack: str | None = None
    drifted: bool = False
    cuda: int = 0
    # MIG GPUs whose instances are laid out on the host (a node agent made them): GPU index ->
    # ((profile key, start), ...). MIG work goes only on those instances there; a GPU in MIG
    # mode not listed takes any valid start (nothing lays it out: the simulated provider).
    mig_layouts: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()
    # Its GPUs change MIG mode only through a relayout (a node agent's), never as a side
    # effect of placing MIG work on an idle whole GPU.
    fixed_mig: bool = False
    # The runtimes work may use here (`process`, `podman`); None: any (no agent decides).
    runtimes: frozenset[str] | None = None


@dataclass
class Alloc:
    tenant: int
    tier: Tier
    node: int
    slots: tuple[int, ...]
    milli: int
    gpu_mem: int
    cpu: int
    mem: int
    mig: str | None = None
    mig_start: int | None = None
    whole_node: bool = False


class Snapshot:
    """A mutable fleet snapshot with free-capacity indexes and an undo log."""

    def __init__(self, nodes: list[NodeSpec]):
        if not nodes:
            raise ValueError("a snapshot needs at least one node")
        n = len(nodes)
        g = max(s.gpus for s in nodes)
        self.max_gpus = g
        self.token = next(_TOKENS)  # identifies this snapshot to policy caches
        self.node_names = [s.name for s in nodes]
        self.node_index = {name: i for i, name in enumerate(self.node_names)}
        if len(self.node_index) != n:
            raise ValueError("node names must be unique")
        self.model_names: list[str] = sorted({s.model for s in nodes})
        self.model_id = {m: i for i, m in enumerate(self.model_names)}
        self._init_levels(nodes)
        self._init_nodes(nodes)
        self._init_gpus(nodes)
        self._init_models()
        self._init_topology()
        self._init_allocations()
        self._init_indexes(n)

    def _init_levels(self, nodes: list[NodeSpec]) -> None:
        """Each node's topology group per level (NVLink domain, rack, block), and its region."""
        n = len(nodes)
        self.level_names: dict[Level, list[str]] = {}
        level_ids: dict[Level, np.ndarray] = {}
        for level, attr in (
            (Level.NVLINK_DOMAIN, "domain"),
            (Level.RACK, "rack"),
            (Level.BLOCK, "block"),
        ):
            names: dict[str, int] = {}
            ids = np.empty(n, np.int32)
            for i, s in enumerate(nodes):
                key = _group_name(s, attr)
                ids[i] = names.setdefault(key, len(names))
            self.level_names[level] = list(names)
            level_ids[level] = ids
        self.node_level = level_ids
        self.region_names = sorted({s.region for s in nodes})
        rid = {r: i for i, r in enumerate(self.region_names)}
        self.node_region = np.array([rid[s.region] for s in nodes], np.int32)

    def _init_nodes(self, nodes: list[NodeSpec]) -> None:
        """Per node: model, GPUs, host capacity and what is free of it, claims."""
        n = len(nodes)
        self.node_model = np.array([self.model_id[s.model] for s in nodes], np.int16)
        self.node_ngpu = np.array([s.gpus for s in nodes], np.int16)
        self.node_cpu_cap = np.array([s.cpu_milli for s in nodes], np.int64)
        self.node_mem_cap = np.array([s.mem_mib for s in nodes], np.int64)
        self.node_cpu_free = self.node_cpu_cap.copy()
        self.node_mem_free = self.node_mem_cap.copy()
        self.node_sched = np.array([s.schedulable for s in nodes], np.bool_)
        self.node_perf = np.array([s.perf for s in nodes], np.float32)
        self.node_excl = np.full(n, NO_TENANT, np.int32)  # whole-node claim (confidential VM)
        self.node_allocs = np.zeros(n, np.int32)
        # Confidential VMs on a node whose model sets CC mode node-wide (Hopper HGX: all GPUs
        # in CC mode or none): while any is there, the node takes nothing else, and a
        # confidential VM goes only where nothing else is (isolation.cc_mode_ok).
        self.node_cc = np.zeros(n, np.int32)
        # Software: each node's stack (an id into stack_names; "" is none declared), drift and
        # CUDA version. A gang never spans two stacks nor lands on a drifted node.
        self.stack_names: list[str] = sorted({s.stack or "" for s in nodes})
        self.stack_id = {name: i for i, name in enumerate(self.stack_names)}
        self.node_stack = np.array([self.stack_id[s.stack or ""] for s in nodes], np.int16)
        self.node_drifted = np.array([s.drifted for s in nodes], np.bool_)
        self.any_drifted = bool(self.node_drifted.any())
        self.node_cuda = np.array([s.cuda for s in nodes], np.int32)
        self.node_runtimes = [s.runtimes for s in nodes]
        self.any_runtime_bound = any(r is not None for r in self.node_runtimes)
        self._runtime_masks: dict[str, np.ndarray] = {}
        self.node_fixed_mig = np.array([s.fixed_mig for s in nodes], np.bool_)

    def runtime_mask(self, runtime: str) -> np.ndarray:
        """The nodes where a run of `runtime` may go (those that name no runtimes: any)."""
        mask = self._runtime_masks.get(runtime)
        if mask is None:
            mask = np.array([r is None or runtime in r for r in self.node_runtimes], np.bool_)
            self._runtime_masks[runtime] = mask
        return mask

    def runtime_everywhere(self, runtime: str) -> bool:
        """Whether every node takes `runtime` (then it filters nothing)."""
        return not self.any_runtime_bound or bool(self.runtime_mask(runtime).all())

    def _init_gpus(self, nodes: list[NodeSpec]) -> None:
        """Per (node, GPU slot): presence, free milli and memory, health, speed, MIG, tenancy."""
        n, g = len(nodes), self.max_gpus
        present = np.arange(g)[None, :] < self.node_ngpu[:, None]
        self.gpu_present = present
        self.gpu_free = np.where(present, 1000, -1).astype(np.int16)
        mem_cap = np.array([_gpu_mem(s) for s in nodes], np.int32)
        self.gpu_mem_cap = np.where(present, mem_cap[:, None], 0).astype(np.int32)
        self.gpu_mem_free = self.gpu_mem_cap.copy()
        self.gpu_health = np.full((n, g), HEALTHY, np.int8)
        self.gpu_perf = np.ones((n, g), np.float32)
        self.gpu_mig = np.zeros((n, g), np.bool_)
        self.gpu_mig_mask = np.zeros((n, g), np.int16)
        self.gpu_mig_compute = np.zeros((n, g), np.int8)
        self.gpu_mig_count = np.zeros((n, g), np.int8)
        self.gpu_tier = np.zeros((n, g), np.int8)
        self.gpu_tenant = np.full((n, g), NO_TENANT, np.int32)
        # flat GPU -> its laid-out MIG instances, ((profile key, start), ...)
        self.gpu_layout: dict[int, tuple[tuple[str, int], ...]] = {}
        for i, s in enumerate(nodes):
            for slot in s.mig_gpus:
                self.gpu_mig[i, slot] = True
            for slot, layout in s.mig_layouts:
                self.gpu_layout[i * g + slot] = tuple(layout)
            if s.gpu_health is not None:
                self.gpu_health[i, : len(s.gpu_health)] = s.gpu_health
            if s.gpu_perf is not None:
                self.gpu_perf[i, : len(s.gpu_perf)] = s.gpu_perf

    def _init_models(self) -> None:
        """Per GPU model, from the catalog: confidential computing and MIG."""
        self.model_cc_whole_node = [
            GPU_MODELS[m].cc_whole_node if m in GPU_MODELS else False for m in self.model_names
        ]
        self.model_confidential = [
            GPU_MODELS[m].confidential if m in GPU_MODELS else False for m in self.model_names
        ]
        self.model_mig_capable = [
            GPU_MODELS[m].mig_capable if m in GPU_MODELS else False for m in self.model_names
        ]

    def _init_topology(self) -> None:
        """The nodes of each topology group, and the GPUs of each NVLink domain."""
        level_ids = self.node_level
        self.group_nodes: dict[Level, list[list[int]]] = {
            level: [[] for _ in self.level_names[level]] for level in Level
        }
        for i in range(len(self.node_names)):
            for level in Level:
                self.group_nodes[level][int(level_ids[level][i])].append(i)
        dom = level_ids[Level.NVLINK_DOMAIN]
        self.domain_gpus = np.bincount(dom, weights=self.node_ngpu).astype(np.int64)
        self.domain_free = np.zeros(len(self.domain_gpus), np.int64)  # whole-free GPUs
        self.multi_node_domains = bool((np.bincount(dom) > 1).any())
        self.node_in_multi_domain = self.domain_gpus[dom] > self.node_ngpu
        # Plain-list copies of the static topology, for the small-set scoring paths.
        self.node_domain_l: list[int] = dom.tolist()
        self.domain_gpus_l: list[int] = self.domain_gpus.tolist()
        self.node_in_multi_domain_l: list[bool] = self.node_in_multi_domain.tolist()

    def _init_allocations(self) -> None:
        """Tenants, allocations and the undo log: empty."""
        self.tenants: dict[str, int] = {}
        self.tenant_names: list[str] = []
        self.allocs: dict[int, Alloc] = {}
        self.holders: dict[int, set[int]] = {}
        # GPUs the placement core put into MIG mode; back to whole GPUs once idle again.
        self.converted: dict[int, bool] = {}
        self._next_alloc = 1
        self._log: list[tuple] = []

    def _init_indexes(self, n: int) -> None:
        """The free-capacity indexes and change tracking, built for every node."""
        # Indexes (derived from the arrays; rebuilt per node by _reindex).
        self.whole: dict[tuple[int, int], SortedList] = {}
        self.frac: dict[tuple[int, int, int], SortedList] = {}
        self.migx: dict[tuple[int, str], SortedList] = {}
        self.group_free: dict[tuple[int, int, int], int] = {}
        # Topology groups by free GPUs, for gangs. Kept lazily: allocations only mark groups
        # dirty, and `groups_with_free` re-sorts the few that changed when a gang asks.
        self._group_sorted: dict[tuple[int, int], SortedList] = {}
        self._group_indexed: dict[tuple[int, int, int], int] = {}
        self._group_dirty: set[tuple[int, int, int]] = set()
        # Bumped whenever a node changes, so policies can cache per-node derived values.
        self.node_version = np.zeros(n, np.int64)
        # Nodes changed, in order; consumers remember how far they have read (`changes_since`).
        self.changed: list[int] = []
        self.changed_epoch = 0
        # Derived in _reindex: nodes with a degraded GPU or below nominal speed, and their count,
        # so scorers can skip health work on a healthy fleet.
        self.node_flagged = np.zeros(n, np.bool_)
        self.flagged_nodes = 0
        self._wkey: list[tuple[int, int] | None] = [None] * n
        # Per node, its whole free GPU slots in order (read, never changed, outside this class).
        self.free_slots: list[tuple[int, ...]] = [()] * n
        self._contrib = np.zeros(n, np.int32)
        self._fkey: dict[int, tuple[tuple[int, int, int], tuple[int, int]]] = {}
        self._mkeys: dict[int, list[tuple[tuple[int, str], tuple[int, int]]]] = {}
        for i in range(n):
            self._reindex(i)

    # --- tenants ----------------------------------------------------------------------------

    def tenant_id(self, name: str) -> int:
        tid = self.tenants.get(name)
        if tid is None:
            tid = self.tenants[name] = len(self.tenant_names)
            self.tenant_names.append(name)
        return tid

    # --- the undo log -----------------------------------------------------------------------

    def checkpoint(self) -> int:
        return len(self._log)

    def rollback(self, mark: int = 0) -> None:
        touched: set[int] = set()
        log = self._log
        while len(log) > mark:
            entry = log.pop()
            if entry[0] == _ARR:
                _, arr, idx, old, node = entry
                arr[idx] = old
                touched.add(node)
            else:
                _, d, key, old, existed = entry
                if existed:
                    d[key] = old
                else:
                    d.pop(key, None)
        for node in touched:
            self._reindex(node)

    def commit(self) -> None:
        self._log.clear()
        if len(self.changed) > 1_000_000:
            self.changed = []
            self.changed_epoch += 1

    def changes_since(self, epoch: int, pos: int) -> tuple[list[int] | None, int, int]:
        """Nodes changed since (epoch, pos); None means "too old: compare versions instead"."""
        if epoch != self.changed_epoch:
            return None, self.changed_epoch, len(self.changed)
        return self.changed[pos:], epoch, len(self.changed)

    def _w(self, arr: np.ndarray, idx: Any, value: Any, node: int) -> None:
        """Logged scalar write: arr[idx] = value (idx an int or an (n, slot) tuple)."""
        self._log.append((_ARR, arr, idx, arr.item(idx), node))
        arr[idx] = value

    def _d(self, d: dict, key: Any, value: Any) -> None:
        existed = key in d
        self._log.append((_DICT, d, key, d.get(key), existed))
        if value is _DELETE:
            d.pop(key, None)
        else:
            d[key] = value

    # --- derived per-GPU facts --------------------------------------------------------------

    def is_whole_free(self, n: int, s: int) -> bool:
        return s in self.free_slots[n]

    def whole_free_slots(self, n: int) -> list[int]:
        """GPU slots of node n that are entirely free (cached; kept current by _reindex)."""
        return list(self.free_slots[n])

    def node_open(self, n: int) -> bool:
        return bool(self.node_sched[n]) and self.node_excl[n] == NO_TENANT

    # --- index maintenance ------------------------------------------------------------------

    def _reindex(self, n: int) -> None:
        """Bring every index entry of node n in line with its arrays."""
        self.node_version[n] += 1
        self.changed.append(n)
        model = int(self.node_model[n])
        open_ = bool(self.node_sched[n]) and int(self.node_excl[n]) == NO_TENANT
        ng = int(self.node_ngpu[n])
        free = self.gpu_free[n, :ng].tolist()
        mig = self.gpu_mig[n, :ng].tolist()
        health = self.gpu_health[n, :ng].tolist()
        tier = self.gpu_tier[n, :ng].tolist()
        flagged = (
            DEGRADED in health
            or float(self.node_perf[n]) < 1.0
            or bool((self.gpu_perf[n, :ng] < 1.0).any())
        )
        if flagged != bool(self.node_flagged[n]):
            self.node_flagged[n] = flagged
            self.flagged_nodes += 1 if flagged else -1
        self._reindex_whole(n, model, open_, ng, free, mig, health, tier)
        self._reindex_slots(n, model, open_, ng, free, mig, health, tier)

    def _reindex_whole(
        self,
        n: int,
        model: int,
        open_: bool,
        ng: int,
        free: list,
        mig: list,
        health: list,
        tier: list,
    ) -> None:
        """Node n's whole free GPUs: its slots, its bucket by count, its groups' free totals."""
        wslots = tuple(
            i
            for i in range(ng)
            if free[i] == 1000 and not mig[i] and health[i] != FAILED and tier[i] == 0
        )
        self.free_slots[n] = wslots
        k = len(wslots) if open_ else 0
        key = (model, k) if k > 0 else None
        old = self._wkey[n]
        if key != old:
            if old is not None:
                self.whole[old].remove(n)
            if key is not None:
                bucket = self.whole.get(key)
                if bucket is None:
                    bucket = self.whole[key] = SortedList()
                bucket.add(n)
            self._wkey[n] = key
        delta = k - int(self._contrib[n])
        if delta:
            self.domain_free[self.node_level[Level.NVLINK_DOMAIN][n]] += delta
            for level in Level:
                gkey = (int(level), int(self.node_level[level][n]), model)
                self.group_free[gkey] = self.group_free.get(gkey, 0) + delta
                self._group_dirty.add(gkey)
            self._contrib[n] = k

    def _reindex_slots(
        self,
        n: int,
        model: int,
        open_: bool,
        ng: int,
        free: list,
        mig: list,
        health: list,
        tier: list,
    ) -> None:
        """Node n's per-GPU entries: fractional capacity by tier and tenant, free MIG profiles."""
        base = n * self.max_gpus
        tenant = self.gpu_tenant[n, :ng].tolist()
        any_mig = any(mig)
        if any_mig:
            mask = self.gpu_mig_mask[n, :ng].tolist()
            comp = self.gpu_mig_compute[n, :ng].tolist()
            cnt = self.gpu_mig_count[n, :ng].tolist()
        for slot in range(ng):
            flat = base + slot
            usable = open_ and health[slot] != FAILED
            t, f = tier[slot], free[slot]
            fkey = None
            if usable and t in _FRACTION_CODES and 0 < f < 1000:
                fkey = ((model, t, tenant[slot]), (f, flat))
            old_f = self._fkey.get(flat)
            if fkey != old_f:
                if old_f is not None:
                    self.frac[old_f[0]].remove(old_f[1])
                    del self._fkey[flat]
                if fkey is not None:
                    self.frac.setdefault(fkey[0], SortedList()).add(fkey[1])
                    self._fkey[flat] = fkey
            if not any_mig and flat not in self._mkeys:
                continue
            mkeys: list = []
            if usable and mig[slot]:
                c_ = comp[slot]
                laid = self.gpu_layout.get(flat)
                keys = (
                    fitting_profiles(mask[slot], c_, cnt[slot])
                    if laid is None
                    else laid_free(laid, mask[slot])
                )
                mkeys = [((model, key), (-c_, flat)) for key in keys]
            old_m = self._mkeys.get(flat, [])
            if mkeys != old_m:
                for k_, v in old_m:
                    self.migx[k_].remove(v)
                for k_, v in mkeys:
                    self.migx.setdefault(k_, SortedList()).add(v)
                if mkeys:
                    self._mkeys[flat] = mkeys
                else:
                    self._mkeys.pop(flat, None)

    def groups_with_free(self, level: Level, model: int, need: int):
        """(free, group id) for groups at `level` with at least `need` whole-free GPUs of
        `model`, fewest free first."""
        for gkey in self._group_dirty:
            lvl, gid, m = gkey
            lst = self._group_sorted.get((lvl, m))
            if lst is None:
                lst = self._group_sorted[(lvl, m)] = SortedList()
            old = self._group_indexed.pop(gkey, 0)
            if old:
                lst.remove((old, gid))
            new = self.group_free.get(gkey, 0)
            if new:
                lst.add((new, gid))
                self._group_indexed[gkey] = new
        self._group_dirty.clear()
        lst = self._group_sorted.get((int(level), model))
        return lst.irange((need, -1)) if lst is not None else iter(())

    # --- operator changes -------------------------------------------------------------------

    def set_schedulable(self, node: str, schedulable: bool) -> None:
        n = self.node_index[node]
        self._w(self.node_sched, n, schedulable, n)
        self._reindex(n)

    def set_gpu_health(self, node: str, slot: int, health: int) -> None:
        n = self.node_index[node]
        self._w(self.gpu_health, (n, slot), health, n)
        self._reindex(n)

    # --- speed ------------------------------------------------------------------------------

    def slot_perf(self, n: int, slot: int) -> float:
        return float(self.node_perf[n]) * float(self.gpu_perf[n, slot])

    def free_slots_by_speed(self, n: int, fastest: bool) -> list[int]:
        """Node n's whole-free slots, healthy before suspect, then fastest (or slowest) first,
        then by index."""
        perf, health = self.gpu_perf[n], self.gpu_health[n]
        sign = -1.0 if fastest else 1.0
        return sorted(
            self.free_slots[n],
            key=lambda x: (int(health[x]) == DEGRADED, sign * float(perf[x]), x),
        )

    def whole_perf(self, n: int, k: int, fastest: bool = True) -> float:
        """The speed of k whole GPUs of node n taken fastest first (a gang runs at its slowest
        member's pace), or of the one slowest free GPU (`fastest=False`, k=1)."""
        slots = self.free_slots_by_speed(n, fastest)
        if len(slots) < k:
            return 0.0
        return min(self.slot_perf(n, x) for x in slots[:k])

    # --- allocation ----------------------------------------------------------------------------

    def allocate(
        self,
        tenant: int,
        tier: Tier,
        n: int,
        slots: tuple[int, ...],
        *,
        milli: int = 0,
        gpu_mem: int = 0,
        cpu: int = 0,
        mem: int = 0,
        mig: MigProfile | None = None,
        mig_start: int | None = None,
        enable_mig: bool = False,
    ) -> int:
        """Record an allocation (the caller has checked it fits). Returns its id."""
        whole_node = False
        if enable_mig:
            for s in slots:
                self._w(self.gpu_mig, (n, s), True, n)
        if mig is not None:
            assert mig_start is not None, "a MIG allocation needs its start slot"
            s = slots[0]
            self._w(
                self.gpu_mig_mask, (n, s), int(self.gpu_mig_mask[n, s]) | mig.mask(mig_start), n
            )
            self._w(self.gpu_mig_compute, (n, s), int(self.gpu_mig_compute[n, s]) + mig.compute, n)
            self._w(self.gpu_mig_count, (n, s), int(self.gpu_mig_count[n, s]) + 1, n)
            self._w(self.gpu_free, (n, s), int(self.gpu_free[n, s]) - mig.gpu_equivalent_milli, n)
            self._share(n, s, tier, tenant)
        elif milli:
            s = slots[0]
            self._w(self.gpu_free, (n, s), int(self.gpu_free[n, s]) - milli, n)
            self._w(self.gpu_mem_free, (n, s), int(self.gpu_mem_free[n, s]) - gpu_mem, n)
            self._share(n, s, tier, tenant)
        else:
            for s in slots:
                self._w(self.gpu_free, (n, s), 0, n)
                self._w(self.gpu_mem_free, (n, s), 0, n)
                self._w(self.gpu_tier, (n, s), int(tier), n)
                self._w(self.gpu_tenant, (n, s), tenant, n)
            whole_node = claims_whole_node(
                tier, len(slots), self.model_cc_whole_node[int(self.node_model[n])]
            )
            if whole_node:
                self._w(self.node_excl, n, tenant, n)
        self._w(self.node_cpu_free, n, int(self.node_cpu_free[n]) - cpu, n)
        self._w(self.node_mem_free, n, int(self.node_mem_free[n]) - mem, n)
        self._w(self.node_allocs, n, int(self.node_allocs[n]) + 1, n)
        if tier is Tier.CONFIDENTIAL_VM and self.model_cc_whole_node[int(self.node_model[n])]:
            self._w(self.node_cc, n, int(self.node_cc[n]) + 1, n)
        aid = self._next_alloc
        self._next_alloc += 1
        self._d(
            self.allocs,
            aid,
            Alloc(
                tenant,
                tier,
                n,
                slots,
                milli,
                gpu_mem,
                cpu,
                mem,
                mig.key if mig else None,
                mig_start,
                whole_node,
            ),
        )
        base = n * self.max_gpus
        for s in slots:
            self._d(self.holders, base + s, self.holders.get(base + s, frozenset()) | {aid})
        self._reindex(n)
        return aid

    def _share(self, n: int, s: int, tier: Tier, tenant: int) -> None:
        held = int(self.gpu_tier[n, s])
        if held == 0:
            self._w(self.gpu_tier, (n, s), int(tier), n)
            self._w(self.gpu_tenant, (n, s), tenant, n)
            return
        new_tier = (
            max(held, int(tier)) if {held, int(tier)} <= {int(t) for t in MIG_TIERS} else held
        )
        new_tenant = int(self.gpu_tenant[n, s])
        if new_tenant != tenant:
            new_tenant = MIXED
        self._w(self.gpu_tier, (n, s), new_tier, n)
        self._w(self.gpu_tenant, (n, s), new_tenant, n)

    def release(self, aid: int) -> list[tuple[str, int]]:
        """Free an allocation. Returns the (node, GPU index) of GPUs that the core had put
        into MIG mode and that are idle now: they go back to whole GPUs (a reconfiguration
        for the caller to carry out)."""
        a = self.allocs[aid]
        n = a.node
        base = n * self.max_gpus
        for s in a.slots:
            remaining = self.holders[base + s] - {aid}
            self._d(self.holders, base + s, remaining if remaining else _DELETE)
        if a.mig is not None:
            assert a.mig_start is not None
            p = PROFILES[a.mig]
            s = a.slots[0]
            self._w(
                self.gpu_mig_mask, (n, s), int(self.gpu_mig_mask[n, s]) & ~p.mask(a.mig_start), n
            )
            self._w(self.gpu_mig_compute, (n, s), int(self.gpu_mig_compute[n, s]) - p.compute, n)
            self._w(self.gpu_mig_count, (n, s), int(self.gpu_mig_count[n, s]) - 1, n)
            self._w(self.gpu_free, (n, s), int(self.gpu_free[n, s]) + p.gpu_equivalent_milli, n)
            self._recompute_share(n, s)
        elif a.milli:
            s = a.slots[0]
            self._w(self.gpu_free, (n, s), int(self.gpu_free[n, s]) + a.milli, n)
            self._w(self.gpu_mem_free, (n, s), int(self.gpu_mem_free[n, s]) + a.gpu_mem, n)
            self._recompute_share(n, s)
        else:
            for s in a.slots:
                self._w(self.gpu_free, (n, s), 1000, n)
                self._w(self.gpu_mem_free, (n, s), int(self.gpu_mem_cap[n, s]), n)
                self._w(self.gpu_tier, (n, s), 0, n)
                self._w(self.gpu_tenant, (n, s), NO_TENANT, n)
            if a.whole_node:
                self._w(self.node_excl, n, NO_TENANT, n)
        self._w(self.node_cpu_free, n, int(self.node_cpu_free[n]) + a.cpu, n)
        self._w(self.node_mem_free, n, int(self.node_mem_free[n]) + a.mem, n)
        self._w(self.node_allocs, n, int(self.node_allocs[n]) - 1, n)
        if a.tier is Tier.CONFIDENTIAL_VM and self.model_cc_whole_node[int(self.node_model[n])]:
            self._w(self.node_cc, n, int(self.node_cc[n]) - 1, n)
        self._d(self.allocs, aid, _DELETE)
        reverted = []
        if a.mig is not None:
            flat = base + a.slots[0]
            if flat in self.converted and not self.holders.get(flat):
                self.set_mig_mode(n, a.slots[0], False)
                reverted.append((self.node_names[n], a.slots[0]))
        self._reindex(n)
        return reverted

    def _recompute_share(self, n: int, s: int) -> None:
        holders = self.holders.get(n * self.max_gpus + s)
        if not holders:
            self._w(self.gpu_tier, (n, s), 0, n)
            self._w(self.gpu_tenant, (n, s), NO_TENANT, n)
            return
        allocs = [self.allocs[h] for h in holders]
        tiers = {int(a.tier) for a in allocs}
        tenants = {a.tenant for a in allocs}
        self._w(self.gpu_tier, (n, s), max(tiers), n)
        self._w(self.gpu_tenant, (n, s), tenants.pop() if len(tenants) == 1 else MIXED, n)

    def set_mig_mode(self, n: int, s: int, enabled: bool, *, converted: bool = False) -> None:
        """Enable/disable MIG mode on an idle GPU (the caller records the reconfiguration).
        `converted`: the placement core did it, so it undoes it when the GPU is idle again."""
        if self.holders.get(n * self.max_gpus + s):
            raise ValueError("MIG mode changes need an idle GPU")
        self._w(self.gpu_mig, (n, s), enabled, n)
        flat = n * self.max_gpus + s
        if enabled and converted:
            self._d(self.converted, flat, True)
        elif not enabled and flat in self.converted:
            self._d(self.converted, flat, _DELETE)
        self._reindex(n)

    # --- sharing checks ----------------------------------------------------------------------

    def may_join(self, n: int, s: int, tier: Tier, tenant: int) -> bool:
        """Whether a new holder of `tier` for `tenant` may share GPU (n, s) with its holders."""
        held = int(self.gpu_tier[n, s])
        if held == 0:
            return True
        return may_share_gpu(Tier(held), int(self.gpu_tenant[n, s]), tier, tenant)

    # --- introspection (tests, what-ifs) ------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything that defines the snapshot, for exact comparisons."""
        arrays = {k: v.copy() for k, v in vars(self).items() if isinstance(v, np.ndarray)}
        return {
            "arrays": arrays,
            "allocs": dict(self.allocs),
            "holders": {k: frozenset(v) for k, v in self.holders.items()},
            "converted": dict(self.converted),
            "whole": {k: list(v) for k, v in self.whole.items() if v},
            "frac": {k: list(v) for k, v in self.frac.items() if v},
            "migx": {k: list(v) for k, v in self.migx.items() if v},
            "group_free": {k: v for k, v in self.group_free.items() if v},
        }

    @property
    def gpu_count(self) -> int:
        return int(self.node_ngpu.sum())

    def used_milli(self) -> int:
        """GPU-milli in use over the fleet (whole GPUs count 1000, MIG slices memory/8)."""
        free = self.gpu_free[self.gpu_present]
        return int(1000 * free.size - free.sum())


_TOKENS = itertools.count(1)


class _Delete:
    pass


_DELETE = _Delete()


def _group_name(s: NodeSpec, attr: str) -> str:
    if attr == "domain":
        return f"{s.region}/{s.domain}" if s.domain else f"{s.region}/node:{s.name}"
    if attr == "rack":
        return f"{s.region}/{s.rack}" if s.rack else f"{s.region}/node:{s.name}"
    if s.block:
        return f"{s.region}/{s.block}"
    return f"{s.region}/{s.rack}" if s.rack else f"{s.region}/node:{s.name}"


def _gpu_mem(s: NodeSpec) -> int:
    if s.gpu_mem_mib is not None:
        return s.gpu_mem_mib
    model = GPU_MODELS.get(s.model)
    return model.memory_mib if model else 16 * 1024
