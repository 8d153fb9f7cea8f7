"""place(snapshot, requests, policy) -> Plan.

The engine turns a request into candidates from the snapshot's free-capacity indexes, lets the
policy (plus the health/performance and topology scorers) rank them, and records the choice in
the snapshot and the plan. Gangs are all or nothing: every replica is placed inside one
checkpoint, and a failure rolls the snapshot back to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from app.placement.isolation import Tier
from app.placement.mig import PROFILES, MigProfile, best_start, laid_start
from app.placement.model import (
    Binding,
    Level,
    Outcome,
    Reconfiguration,
    Request,
    RequestError,
    Shape,
)
from app.placement.snapshot import DEGRADED, FAILED, Snapshot

UNLIMITED = -1  # `limit=UNLIMITED`: every candidate, whatever the engine's default limit

# Candidate kinds.
WHOLE, FRAC_SHARED, FRAC_FRESH, MIG_SHARED, MIG_CONVERT, CPU_ONLY = range(6)


@dataclass
class Candidates:
    """Feasible placements of one replica, as parallel arrays."""

    node: np.ndarray
    slot: np.ndarray  # GPU slot for fractional/MIG candidates; -1 for whole-GPU ones
    kind: np.ndarray

    def __len__(self) -> int:
        return len(self.node)


@dataclass
class Plan:
    """Bindings and reconfigurations decided over a snapshot, with its undo log."""

    snapshot: Snapshot
    outcomes: list[Outcome] = field(default_factory=list)
    reconfigurations: list[Reconfiguration] = field(default_factory=list)

    @property
    def bindings(self) -> list[Binding]:
        return [b for o in self.outcomes for b in o.bindings]

    def checkpoint(self) -> tuple[int, int, int]:
        return self.snapshot.checkpoint(), len(self.outcomes), len(self.reconfigurations)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        log, outcomes, reconfs = mark
        self.snapshot.rollback(log)
        del self.outcomes[outcomes:]
        del self.reconfigurations[reconfs:]

    def commit(self) -> None:
        self.snapshot.commit()


NO_SOFTWARE = "no node runs the software it asks for (its stack, CUDA version or runtime)"


class Engine:
    """Placement over one snapshot with one policy (and its scorers)."""

    def __init__(
        self,
        snapshot: Snapshot,
        policy,
        *,
        candidate_limit: int | None = None,
        allow_mig_reconfigure: bool = True,
    ):
        self.snap = snapshot
        self.policy = policy
        limit = candidate_limit if candidate_limit is not None else policy.candidate_limit
        self.limit = limit
        self.allow_mig_reconfigure = allow_mig_reconfigure

    # --- public -----------------------------------------------------------------------------

    def place(self, requests: list[Request], plan: Plan | None = None) -> Plan:
        plan = plan or Plan(self.snap)
        for req in requests:
            plan.outcomes.append(self.place_one(req, plan))
        return plan

    def place_one(self, req: Request, plan: Plan) -> Outcome:
        try:
            req.validate()
        except RequestError as exc:
            return Outcome(req.id, False, reason=f"invalid: {exc}")
        if req.replicas == 1 and req.topology is None:
            eligible = self.software_ok(req)
            if eligible == set():
                return Outcome(req.id, False, reason=NO_SOFTWARE)
            binding = self._place_replica(req, 0, plan, eligible, None)
            if binding is None:
                return Outcome(req.id, False, reason="no capacity")
            return Outcome(req.id, True, [binding])
        mark = plan.checkpoint()
        options = self._stack_options(req)
        if options == [set()]:
            return Outcome(req.id, False, reason=NO_SOFTWARE)
        for eligible in options:
            bindings = self._place_gang(req, plan, eligible)
            if bindings is not None:
                return Outcome(req.id, True, bindings)
            plan.rollback(mark)
        return Outcome(req.id, False, reason="gang does not fit (all or nothing)")

    # --- software -----------------------------------------------------------------------------

    def software_ok(self, req: Request, stack: int | None = None) -> set[int] | None:
        """The nodes whose software may run `req` (None: any node): its stack if it asks for
        one, at least its CUDA version, its runtime, and for a gang (more than one replica) no
        drifted node and only nodes of `stack`. A request that asks for nothing costs nothing
        here."""
        s = self.snap
        gang = req.replicas > 1
        # A runtime every node offers constrains nothing (and changes no candidate order).
        bound = req.runtime is not None and not s.runtime_everywhere(req.runtime)
        if req.stack is None and not req.min_cuda and not (gang and s.any_drifted) and not bound:
            if stack is None:
                return None
        mask = np.ones(len(s.node_names), np.bool_)
        if bound:
            assert req.runtime is not None
            mask &= s.runtime_mask(req.runtime)
        if req.stack is not None:
            sid = s.stack_id.get(req.stack)
            if sid is None or not req.stack:
                return set()
            mask &= s.node_stack == sid
        if req.min_cuda:
            mask &= s.node_cuda >= req.min_cuda
        if gang:
            mask &= ~s.node_drifted
        if stack is not None:
            mask &= s.node_stack == stack
        return set(np.flatnonzero(mask).tolist())

    def _stack_options(self, req: Request) -> list[set[int] | None]:
        """Where a gang may go, one stack at a time: a one-version skew inside a synchronous
        job hangs it, so its replicas never span two stacks. Tried tightest first (the stack
        with the fewest whole free GPUs, for whole-GPU gangs; else by name), as groups are."""
        s = self.snap
        if req.replicas == 1 or req.stack is not None or len(s.stack_names) == 1:
            return [self.software_ok(req)]
        options: list[set[int] | None] = []
        for sid in range(len(s.stack_names)):
            nodes = self.software_ok(req, sid)
            if nodes:
                options.append(nodes)
        if req.shape.gpus:
            need = req.replicas * req.shape.gpus
            free = [sum(len(s.free_slots[n]) for n in o or ()) for o in options]
            ranked = sorted(
                (f, i) for i, f in enumerate(free) if f >= need
            )  # enough whole free GPUs in total, tightest first
            return [options[i] for _, i in ranked]
        return options

    # --- candidates ---------------------------------------------------------------------------

    def allowed_models(self, shape: Shape, tier: Tier | None = None) -> list[int]:
        """Model ids the shape may use (a confidential VM: models with confidential computing)."""
        s = self.snap
        ids = (
            range(len(s.model_names))
            if shape.models is None
            else [s.model_id[m] for m in shape.models if m in s.model_id]
        )
        if tier is Tier.CONFIDENTIAL_VM:
            return [m for m in ids if s.model_confidential[m]]
        return list(ids)

    def candidates(
        self, req: Request, tenant: int, nodes: set[int] | None = None, limit: int | None = None
    ) -> Candidates:
        """Feasible placements for one replica, from the indexes (at most `limit` per source).

        Exhaustive policies (no limit) on a whole-fleet search take the vectorised scan, which
        returns the same set (a property test holds the two to each other)."""
        if nodes is None and limit is None and self.limit is None and req.shape.mig is None:
            return self.scan(req, tenant)
        shape = req.shape
        limit = self.limit if limit is None else (None if limit == UNLIMITED else limit)
        models = self.allowed_models(shape, req.tier)
        host_ok = self._host_ok(req, nodes)
        if shape.cpu_only:
            return self._cpu_only_candidates(shape, nodes)
        if shape.gpus:
            return self._whole_candidates(req, models, host_ok, limit)
        if shape.mig is not None:
            profile = PROFILES[shape.mig]
            return self._mig_candidates(req, tenant, profile, models, host_ok, limit)
        return self._fractional_candidates(req, tenant, models, host_ok, limit)

    def _host_ok(self, req: Request, nodes: set[int] | None) -> Callable[[int], bool]:
        """Whether node n may host a replica of `req`: among `nodes`, host CPU and memory
        free, and confidential computing mode compatible."""
        s = self.snap
        cpu, mem = req.shape.cpu_milli, req.shape.mem_mib

        cpu_free, mem_free = s.node_cpu_free.item, s.node_mem_free.item

        cc_node = s.model_cc_whole_node
        node_model, node_cc, node_allocs = s.node_model.item, s.node_cc.item, s.node_allocs.item
        if req.tier is Tier.CONFIDENTIAL_VM:  # a CC-mode node: only confidential VMs on it

            def cc_ok(n: int) -> bool:
                return not cc_node[node_model(n)] or node_allocs(n) == node_cc(n)
        else:

            def cc_ok(n: int) -> bool:
                return node_cc(n) == 0

        def host_ok(n: int) -> bool:
            return (
                (nodes is None or n in nodes)
                and cpu_free(n) >= cpu
                and mem_free(n) >= mem
                and cc_ok(n)
            )

        return host_ok

    def _cpu_only_candidates(self, shape: Shape, nodes: set[int] | None) -> Candidates:
        s = self.snap
        cpu, mem = shape.cpu_milli, shape.mem_mib
        out_n: list[int] = []
        out_s: list[int] = []
        out_k: list[int] = []
        for node_id in np.flatnonzero(
            (s.node_cpu_free >= cpu)
            & (s.node_mem_free >= mem)
            & s.node_sched
            & (s.node_excl < 0)
            & (s.node_cc == 0)
        ):
            if nodes is None or int(node_id) in nodes:
                out_n.append(int(node_id))
                out_s.append(-1)
                out_k.append(CPU_ONLY)
        return _cands(out_n, out_s, out_k)

    def _whole_candidates(
        self, req: Request, models: list[int], host_ok: Callable[[int], bool], limit: int | None
    ) -> Candidates:
        """Nodes with enough whole free GPUs."""
        s = self.snap
        out_n: list[int] = []
        out_s: list[int] = []
        out_k: list[int] = []
        need = req.shape.gpus
        whole_node = req.tier is Tier.CONFIDENTIAL_VM and need > 1
        for m in models:
            if whole_node and s.model_cc_whole_node[m]:
                # A multi-GPU confidential VM on Hopper takes an empty node.
                def empty_node(n: int) -> bool:
                    return (
                        host_ok(n)
                        and int(s.node_allocs[n]) == 0
                        and len(s.free_slots[n]) == int(s.node_ngpu[n])
                    )

                for n in self._whole_nodes(m, need, empty_node, limit):
                    out_n.append(n)
                    out_s.append(-1)
                    out_k.append(WHOLE)
                continue
            for n in self._whole_nodes(m, need, host_ok, limit):
                out_n.append(n)
                out_s.append(-1)
                out_k.append(WHOLE)
        return _cands(out_n, out_s, out_k)

    def _mig_candidates(
        self,
        req: Request,
        tenant: int,
        profile: MigProfile,
        models: list[int],
        host_ok: Callable[[int], bool],
        limit: int | None,
    ) -> Candidates:
        """GPUs in MIG mode with room for the profile, then idle GPUs to convert (not on
        nodes whose MIG layouts only their agents change)."""
        s = self.snap
        fixed = s.node_fixed_mig

        def convertible(n: int) -> bool:
            return not fixed[n] and host_ok(n)

        out_n: list[int] = []
        out_s: list[int] = []
        out_k: list[int] = []
        for m in models:
            if not s.model_mig_capable[m]:
                continue
            count = 0
            for _neg, flat in s.migx.get((m, profile.key), ()):
                n, slot = divmod(flat, s.max_gpus)
                if host_ok(n) and s.may_join(n, slot, req.tier, tenant):
                    out_n.append(n)
                    out_s.append(slot)
                    out_k.append(MIG_SHARED)
                    count += 1
                    if limit is not None and count >= limit:
                        break
            # At scale (a candidate limit), converting an idle GPU is only considered when
            # no GPU already in MIG mode has room: MIG slices pack onto MIG GPUs first.
            if self.allow_mig_reconfigure and (limit is None or count == 0):
                for n in self._whole_nodes(m, 1, convertible, limit):
                    out_n.append(n)
                    out_s.append(self._healthiest_free_slot(n, first=False))
                    out_k.append(MIG_CONVERT)
        return _cands(out_n, out_s, out_k)

    def _fractional_candidates(
        self,
        req: Request,
        tenant: int,
        models: list[int],
        host_ok: Callable[[int], bool],
        limit: int | None,
    ) -> Candidates:
        """Fractional share: partly used GPUs of this tenant and tier, then whole-free GPUs."""
        s = self.snap
        shape = req.shape
        out_n: list[int] = []
        out_s: list[int] = []
        out_k: list[int] = []
        for m in models:
            index = s.frac.get((m, int(req.tier), tenant))
            count = 0
            if index:
                for _free, flat in index.irange((shape.milli, -1)):
                    n, slot = divmod(flat, s.max_gpus)
                    if s.gpu_mem_free[n, slot] >= shape.gpu_mem_mib and host_ok(n):
                        out_n.append(n)
                        out_s.append(slot)
                        out_k.append(FRAC_SHARED)
                        count += 1
                        if limit is not None and count >= limit:
                            break

            def fresh_ok(n: int) -> bool:
                return host_ok(n) and s.gpu_mem_free[n, s.free_slots[n][0]] >= shape.gpu_mem_mib

            for n in self._whole_nodes(m, 1, fresh_ok, limit):
                out_n.append(n)
                out_s.append(self._healthiest_free_slot(n, first=True))
                out_k.append(FRAC_FRESH)
        return _cands(out_n, out_s, out_k)

    def scan(self, req: Request, tenant: int) -> Candidates:
        """All feasible placements by a vectorised scan of the arrays (no index)."""
        s = self.snap
        shape = req.shape
        model_ok = np.zeros(len(s.model_names), np.bool_)
        model_ok[self.allowed_models(shape, req.tier)] = True
        cc_node = np.asarray(s.model_cc_whole_node, np.bool_)[s.node_model]
        node_ok = (
            model_ok[s.node_model]
            & s.node_sched
            & (s.node_excl < 0)
            & (s.node_cpu_free >= shape.cpu_milli)
            & (s.node_mem_free >= shape.mem_mib)
            & (
                (~cc_node | (s.node_allocs == s.node_cc))
                if req.tier is Tier.CONFIDENTIAL_VM
                else (s.node_cc == 0)
            )
        )
        if shape.cpu_only:
            n = np.flatnonzero(node_ok)
            return Candidates(n, np.full(len(n), -1, np.int64), np.full(len(n), CPU_ONLY, np.int8))
        usable = (s.gpu_health != FAILED) & ~s.gpu_mig
        whole_free = usable & (s.gpu_free == 1000) & (s.gpu_tier == 0)
        if shape.gpus:
            count = whole_free.sum(axis=1)
            ok = node_ok & (count >= shape.gpus)
            if req.tier is Tier.CONFIDENTIAL_VM and shape.gpus > 1:
                cc = np.asarray(s.model_cc_whole_node, np.bool_)[s.node_model]
                ok &= ~cc | ((s.node_allocs == 0) & (count == s.node_ngpu))
            n = np.flatnonzero(ok)
            return Candidates(n, np.full(len(n), -1, np.int64), np.full(len(n), WHOLE, np.int8))
        shared = (
            usable
            & (s.gpu_tier == int(req.tier))
            & (s.gpu_tenant == tenant)
            & (s.gpu_free >= shape.milli)
            & (s.gpu_mem_free >= shape.gpu_mem_mib)
        )
        fresh = whole_free & (s.gpu_mem_free >= shape.gpu_mem_mib)
        mask = (shared | fresh) & node_ok[:, None]
        n, slot = np.nonzero(mask)
        kind = np.where(fresh[n, slot], FRAC_FRESH, FRAC_SHARED).astype(np.int8)
        return Candidates(n.astype(np.int64), slot.astype(np.int64), kind)

    def _healthiest_free_slot(self, n: int, first: bool) -> int:
        """A whole-free slot of node n for work at one GPU's pace: healthy ones first, the
        slowest of those (fast GPUs stay whole for gangs), then the lowest index (or the
        highest, for MIG)."""
        s = self.snap
        slots = s.free_slots[n] if first else tuple(reversed(s.free_slots[n]))
        if s.node_flagged[n]:
            perf, health = s.gpu_perf[n], s.gpu_health[n]
            return min(slots, key=lambda x: (int(health[x]) == DEGRADED, float(perf[x])))
        return slots[0]

    def _whole_nodes(self, model: int, need: int, host_ok, limit: int | None) -> list[int]:
        """Nodes of `model` with at least `need` whole-free GPUs, tightest first."""
        s = self.snap
        out: list[int] = []
        for k in range(need, s.max_gpus + 1):
            bucket = s.whole.get((model, k))
            if not bucket:
                continue
            for n in bucket:
                if host_ok(n):
                    out.append(n)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    # --- one replica --------------------------------------------------------------------------

    def _place_replica(
        self,
        req: Request,
        replica: int,
        plan: Plan,
        nodes: set[int] | None,
        perf_class: float | None,
    ) -> Binding | None:
        s = self.snap
        tenant = s.tenant_id(req.tenant)
        cands = self.candidates(req, tenant, nodes)
        if req.avoid and len(cands):
            names = s.node_names
            keep = np.array(
                [
                    x < 0 or (names[n], x) not in req.avoid
                    for n, x in zip(cands.node.tolist(), cands.slot.tolist(), strict=True)
                ],
                dtype=bool,
            )
            cands = Candidates(cands.node[keep], cands.slot[keep], cands.kind[keep])
        if not len(cands):
            return None
        scores = np.asarray(self.policy.score(s, req, cands), dtype=np.float64)
        scores = scores + self._health_penalty(cands, perf_class, req.shape.gpus, req.replicas)
        i = self.policy.pick(scores, cands, s)
        return self._apply(
            req, replica, tenant, int(cands.node[i]), int(cands.slot[i]), int(cands.kind[i]), plan
        )

    def _health_penalty(
        self, cands: Candidates, perf_class: float | None, gpus: int = 0, replicas: int = 1
    ) -> np.ndarray:
        """Prefer healthy GPUs; send work that runs at several GPUs' pace (a gang, a multi-GPU
        replica) to the fastest, and work at one GPU's pace to the slowest first; keep a gang
        on GPUs of one performance class."""
        s = self.snap
        penalty = self._topology_penalty(cands)
        if perf_class is None and (
            not s.flagged_nodes or not any(map(s.node_flagged.item, cands.node.tolist()))
        ):
            return penalty  # every candidate node is healthy and at nominal speed
        cares = gpus >= 2 or (gpus >= 1 and replicas > 1) or perf_class is not None
        # A node that is not flagged has every GPU healthy at nominal speed: only flagged
        # candidates need a look (a gang's replica would otherwise rank every node each time).
        perf = np.ones(len(cands))
        flagged = np.flatnonzero(s.node_flagged[cands.node])
        if len(flagged):
            nodes = cands.node[flagged].tolist()
            slots, kinds = cands.slot[flagged].tolist(), cands.kind[flagged].tolist()
            perf[flagged] = [
                s.slot_perf(n, x)
                if x >= 0
                else s.whole_perf(n, max(gpus, 1), fastest=cares)
                if k == WHOLE
                else float(s.node_perf[n])
                for n, x, k in zip(nodes, slots, kinds, strict=True)
            ]
        slowness = 1.0 - np.minimum(perf, 1.0)
        if cares:
            penalty = penalty + slowness * self.policy.perf_weight
        else:
            penalty = penalty - slowness * self.policy.slow_first_weight
        slot = np.maximum(cands.slot, 0)
        degraded = (s.gpu_health[cands.node, slot] == DEGRADED) & (cands.slot >= 0)
        if gpus:  # whole GPUs: degraded if the node cannot give `gpus` healthy free GPUs
            rows = cands.node
            healthy_free = (
                (s.gpu_free[rows] == 1000)
                & ~s.gpu_mig[rows]
                & (s.gpu_tier[rows] == 0)
                & (s.gpu_health[rows] == 0)
            ).sum(axis=1)
            degraded = degraded | ((cands.kind == WHOLE) & (healthy_free < gpus))
        penalty = penalty + degraded * self.policy.health_weight
        if perf_class is not None:
            penalty = penalty + (perf_class_of(perf) != perf_class) * self.policy.perf_weight * 10
        return penalty

    def _topology_penalty(self, cands: Candidates) -> np.ndarray:
        """Keep multi-node NVLink domains (NVL72 racks) whole for the gangs that need them:
        work that is not a topology-constrained gang prefers the fullest such domain."""
        s = self.snap
        weight = self.policy.topology_weight
        if not weight or not s.multi_node_domains:
            return np.zeros(len(cands))
        if len(cands) <= 32:  # plain Python: cheaper than numpy's per-call cost at this size
            dom_of, size_of, multi = s.node_domain_l, s.domain_gpus_l, s.node_in_multi_domain_l
            free = s.domain_free.item
            return np.array(
                [
                    weight * free(dom_of[n]) / size_of[dom_of[n]] if multi[n] else 0.0
                    for n in cands.node.tolist()
                ]
            )
        dom = s.node_level[Level.NVLINK_DOMAIN][cands.node]
        multi = s.node_in_multi_domain[cands.node]
        return np.where(multi, weight * s.domain_free[dom] / np.maximum(s.domain_gpus[dom], 1), 0.0)

    def _apply(
        self, req: Request, replica: int, tenant: int, n: int, slot: int, kind: int, plan: Plan
    ) -> Binding:
        s = self.snap
        shape = req.shape
        name = s.node_names[n]
        if kind == CPU_ONLY:
            aid = s.allocate(tenant, req.tier, n, (), cpu=shape.cpu_milli, mem=shape.mem_mib)
            return Binding(aid, req.id, replica, name, ())
        if kind == WHOLE:
            # Healthy GPUs first; the fastest for work at several GPUs' pace, the slowest for
            # one GPU's; then the lowest index.
            cares = shape.gpus >= 2 or req.replicas > 1
            free = s.free_slots_by_speed(n, fastest=cares)
            slots = tuple(sorted(free[: shape.gpus]))
            aid = s.allocate(tenant, req.tier, n, slots, cpu=shape.cpu_milli, mem=shape.mem_mib)
            return Binding(aid, req.id, replica, name, slots)
        if kind in (FRAC_SHARED, FRAC_FRESH):
            aid = s.allocate(
                tenant,
                req.tier,
                n,
                (slot,),
                milli=shape.milli,
                gpu_mem=shape.gpu_mem_mib,
                cpu=shape.cpu_milli,
                mem=shape.mem_mib,
            )
            return Binding(aid, req.id, replica, name, (slot,), milli=shape.milli)
        assert shape.mig is not None
        profile = PROFILES[shape.mig]
        if kind == MIG_CONVERT:
            s.set_mig_mode(n, slot, True, converted=True)
            plan.reconfigurations.append(Reconfiguration(name, slot, True))
        laid = s.gpu_layout.get(n * s.max_gpus + slot)
        if laid is not None:  # its instances exist on the host: one of them
            start = laid_start(laid, profile, int(s.gpu_mig_mask[n, slot]))
        else:
            start = best_start(
                profile,
                int(s.gpu_mig_mask[n, slot]),
                int(s.gpu_mig_compute[n, slot]),
                int(s.gpu_mig_count[n, slot]),
            )
        assert start is not None, "index promised a free MIG slot"
        aid = s.allocate(
            tenant,
            req.tier,
            n,
            (slot,),
            cpu=shape.cpu_milli,
            mem=shape.mem_mib,
            mig=profile,
            mig_start=start,
        )
        return Binding(aid, req.id, replica, name, (slot,), mig_profile=shape.mig, mig_start=start)

    # --- gangs --------------------------------------------------------------------------------

    def _place_gang(
        self, req: Request, plan: Plan, eligible: set[int] | None
    ) -> list[Binding] | None:
        """Every replica or none, on `eligible` nodes (None: any)."""
        topo = req.topology
        if topo is None:
            return self._fill(req, plan, None, eligible=eligible)
        groups = self._groups(req, topo.level)
        tries = 0
        for gid in groups:
            nodes = self.snap.group_nodes[topo.level][gid]
            if eligible is not None:
                nodes = [n for n in nodes if n in eligible]
            if req.shape.gpus and self._whole_capacity(req, nodes) < req.replicas:
                continue  # enough free GPUs in total, but not in node-sized pieces
            tries += 1
            if tries > self.policy.gang_group_tries:
                break
            mark = plan.checkpoint()
            placed = self._fill(req, plan, nodes)
            if placed is not None:
                return placed
            plan.rollback(mark)
        if topo.required:
            return None
        # Preferred: span the fewest groups, the emptiest first, ranks filling one group at a time.
        ordered = self._groups(req, topo.level, need_all=False)
        names = self.snap.node_names
        nodes = [
            n
            for gid in reversed(ordered)
            for n in sorted(self.snap.group_nodes[topo.level][gid], key=lambda x: names[x])
            if eligible is None or n in eligible
        ]
        return self._fill(req, plan, nodes, keep_order=True)

    def _whole_capacity(self, req: Request, nodes: list[int]) -> int:
        """How many whole-GPU replicas of `req` the nodes could take (GPU, CPU, memory)."""
        s = self.snap
        shape = req.shape
        models = set(self.allowed_models(shape, req.tier))
        total = 0
        for n in nodes:
            if int(s.node_model[n]) not in models or not s.node_open(n):
                continue
            k = len(s.free_slots[n]) // shape.gpus
            if shape.cpu_milli:
                k = min(k, int(s.node_cpu_free[n]) // shape.cpu_milli)
            if shape.mem_mib:
                k = min(k, int(s.node_mem_free[n]) // shape.mem_mib)
            total += k
        return total

    def _groups(self, req: Request, level: Level, need_all: bool = True) -> list[int]:
        """Groups at `level` to try for a gang, tightest first (best fit by group).

        Whole-GPU gangs: groups whose whole-free GPUs (summed over the allowed models) cover the
        gang. Other units (MIG, shares, CPU-only) are not counted by the group index: every
        group with a node of an allowed model is a candidate, fullest first."""
        s = self.snap
        models = self.allowed_models(req.shape, req.tier)
        free: dict[int, int] = {}
        for m in models:
            for f, gid in s.groups_with_free(level, m, 1):
                free[gid] = free.get(gid, 0) + f
        if req.shape.gpus:
            need = req.replicas * req.shape.gpus if need_all else 1
            return sorted((g for g in free if free[g] >= need), key=lambda g: (free[g], g))
        allowed = set(models)
        groups = {
            int(s.node_level[level][n])
            for n in range(len(s.node_names))
            if int(s.node_model[n]) in allowed
        }
        return sorted(groups, key=lambda g: (free.get(g, 0), g))

    def _fill(
        self,
        req: Request,
        plan: Plan,
        nodes: list[int] | None,
        keep_order: bool = False,
        eligible: set[int] | None = None,
    ) -> list[Binding] | None:
        """Place every replica; inside a topology group ranks are contiguous (a node is filled
        before the next, in rank order). No group: the policy places each replica (on the
        `eligible` nodes, None: any)."""
        if nodes is None:

            def place(r: int, perf: float | None) -> Binding | None:
                return self._place_replica(req, r, plan, eligible, perf)
        else:
            if keep_order:
                order = list(nodes)
            elif req.shape.gpus and req.replicas > 1:
                order = self._fewest_nodes(req, nodes)
            else:
                order = sorted(nodes, key=lambda n: self.snap.node_names[n])
            allowed = set(order)

            def place(r: int, perf: float | None) -> Binding | None:
                return self._place_replica_in_order(req, r, plan, order, allowed, perf)

        bindings: list[Binding] = []
        perf_class = None
        for r in range(req.replicas):
            b = place(r, perf_class)
            if b is None:
                return None
            if req.same_perf_class and perf_class is None:
                n = self.snap.node_index[b.node]
                speed = (
                    min(self.snap.slot_perf(n, x) for x in b.gpu_indices)
                    if b.gpu_indices
                    else float(self.snap.node_perf[n])
                )
                perf_class = perf_class_of(speed)
            bindings.append(b)
        return bindings

    def _fewest_nodes(self, req: Request, nodes: list[int]) -> list[int]:
        """The group's nodes in the order a whole-GPU gang should fill them: the fewest nodes
        that hold it. A node that holds every replica left, the tightest such; else the node
        that holds the most, and so on (ranks fill one node before the next). Without this a
        gang took the first node by name with room for one replica, then spread."""
        names = self.snap.node_names
        room = {n: self._whole_capacity(req, [n]) for n in nodes}
        pool = sorted((n for n in nodes if room[n]), key=lambda n: names[n])
        order: list[int] = []
        left = req.replicas
        while left > 0 and pool:
            holds_all = [n for n in pool if room[n] >= left]
            pick = (
                min(holds_all, key=lambda n: (room[n], names[n]))
                if holds_all
                else max(pool, key=lambda n: (room[n], -pool.index(n)))
            )
            order.append(pick)
            pool.remove(pick)
            left -= room[pick]
        chosen = set(order)
        return order + sorted((n for n in nodes if n not in chosen), key=lambda n: names[n])

    def _place_replica_in_order(self, req, replica, plan, order, allowed, perf_class):
        """Within a topology group: the first node in rank order that fits (contiguous ranks)."""
        s = self.snap
        tenant = s.tenant_id(req.tenant)
        cands = self.candidates(req, tenant, allowed, limit=UNLIMITED)
        if not len(cands):
            return None
        rank = {n: i for i, n in enumerate(order)}
        penalty = self._health_penalty(cands, perf_class, req.shape.gpus, req.replicas)
        key = np.array([rank[int(n)] for n in cands.node], dtype=np.float64) + penalty * 1e6
        i = int(np.argmin(key))
        return self._apply(
            req, replica, tenant, int(cands.node[i]), int(cands.slot[i]), int(cands.kind[i]), plan
        )


def perf_class_of(perf):
    """Performance classes in steps of 10%: GPUs within one class are interchangeable for a gang."""
    return np.floor(np.asarray(perf) * 10 + 1e-6) / 10


def _cands(n: list[int], s: list[int], k: list[int]) -> Candidates:
    return Candidates(np.asarray(n, np.int64), np.asarray(s, np.int64), np.asarray(k, np.int8))


def place(snapshot: Snapshot, requests: list[Request], policy) -> Plan:
    """Place `requests` in order over `snapshot` with `policy`; returns the plan (uncommitted)."""
    return Engine(snapshot, policy).place(requests)


__all__ = ["Candidates", "Engine", "Plan", "place", "FAILED"]
