"""A node's desired state (what its agent should run) and the agent's reports of what runs.

Level-triggered both ways. The desired state is computed, never queued: the node's live
allocations of provisioning and running workloads (run them) and the allocations that
checkpointing workloads held until their eviction (stop them by their deadline). Anything else
the agent runs, it stops. Reports carry each run's whole current state; one that repeats what
is recorded changes nothing, and one about a run the control plane no longer holds is stale.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from app.agents import inventory, mig
from app.core.config import get_settings
from app.core.db import as_aware, utcnow
from app.core.errors import Conflict
from app.health import burnin, suite, telemetry
from app.health.tasks import report_silence
from app.keys.tenant_secrets import SecretUnavailable, secret_values
from app.models.agents import AgentNode
from app.models.endpoints import Endpoint
from app.models.fleet import Node
from app.models.health import NodeHeartbeat
from app.models.tenants import Tenant
from app.models.workloads import Allocation, State, Workload, WorkloadEvent
from app.outbox.service import enqueue
from app.placement.isolation import Tier
from app.scheduling import lifecycle
from app.scheduling.apply import first_port, release_unstarted
from app.scheduling.providers import FAILED_RUNS, get_provider
from app.tenancy.nodes import NodeCaller
from app.tenancy.run_tokens import STOP_GRACE_S, mint
from app.workloads import runs as workload_runs
from app.workloads.disruptions import interrupt_on_fault
from app.workloads.queueing import kick_placement
from app.workloads.service import end_in_failure, finish
from rackplane_wire import (
    Assignment,
    Assignments,
    Confidential,
    RunEnv,
    RunReport,
    Serve,
    StatusAck,
    StatusReport,
    VolumeMount,
)

RUNNING = (State.provisioning.value, State.running.value)
# A run's placeholder when the workload names no command: it holds its GPUs (an interactive
# instance's), exiting 0 after `run_for_s` when it has one.
HOLD = ["sleep", "infinity"]
TAIL_IN_EVENT = 20
SEC = timedelta(seconds=1)
# How often a gang's failure is looked at again while hosts of its other replicas are quiet.
JUDGE_POLL_S = 1.0
SILENT_BEATS = 2.2


def index_of(session: Session, node_id: uuid.UUID) -> int:
    """The node's desired-state index (0 before its first inventory: nothing to run yet)."""
    return session.scalar(select(AgentNode.desired_index).where(AgentNode.node_id == node_id)) or 0


def _held(node_id: uuid.UUID | None = None):
    """The allocations a node's agent should know of: live ones of workloads starting or
    running, and those checkpointing workloads gave up at their eviction."""
    live = and_(Allocation.released_at.is_(None), Workload.state.in_(RUNNING))
    stopping = and_(
        Workload.state == State.checkpointing.value,
        Allocation.released_at >= Workload.evicted_at,
    )
    stmt = (
        select(Allocation, Workload)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(or_(live, stopping))
    )
    return stmt if node_id is None else stmt.where(Allocation.node_id == node_id)


def assignments(session: Session, caller: NodeCaller) -> Assignments:
    """The node's whole desired state, at its current index."""
    agent = session.get(AgentNode, caller.node_id)
    settings = get_settings()
    heartbeat = settings.heartbeat_timeout_seconds / 3
    if agent is None:
        return Assignments(node=caller.node_name, index=0, assignments=[], heartbeat_s=heartbeat)
    burn = suite.active(session, caller.node_id)
    rows = session.execute(_held(caller.node_id).order_by(Allocation.workload_id)).all()
    masters = _masters(session, {w.id for _, w in rows if w.replicas > 1})
    gids = dict(
        session.execute(
            select(Tenant.id, Tenant.run_gid).where(Tenant.id.in_({w.tenant_id for _, w in rows}))
        ).all()
    )
    devices = _devices(agent.inventory)
    node_offers = set(
        session.scalar(select(Node.agent_offers).where(Node.id == caller.node_id)) or ()
    )
    serves = _serves(session, {w.endpoint_id for _, w in rows if w.endpoint_id is not None})
    now = utcnow()
    out = []
    for a, w in rows:
        local = sorted(b.replica for b, v in rows if v.id == w.id)
        gpus = _device_ids(a, devices)
        env = _env(w, a, gpus, local, masters, agent, caller, settings)
        stopping = w.state == State.checkpointing.value
        deadline = as_aware(w.stop_deadline) if stopping and w.stop_deadline else None
        out.append(
            Assignment(
                workload_id=str(w.id),
                attempt=w.attempts,
                replica=a.replica,
                desired="stop" if stopping else "run",
                runtime=w.runtime,  # type: ignore[arg-type]
                command=list(w.command or _hold(w)),
                image=w.image,
                workdir=w.workdir,
                volumes=[VolumeMount(**v) for v in w.volumes or []],
                env=env,
                fetch_env=True,
                run_gid=gids.get(w.tenant_id),
                tenant=str(w.tenant_id),
                devices=gpus,
                stop_deadline=deadline,
                grace_s=max(0.0, (deadline - now).total_seconds()) if deadline else STOP_GRACE_S,
                checkpoint_signal=w.checkpoint_signal,
                checkpoint_requests=w.checkpoint_requests,
                cpu_milli=a.cpu_milli,
                memory_mib=a.memory_mib,
                ssh_keys=list(w.ssh_keys or []),
                serve=serves.get(w.endpoint_id) if w.endpoint_id is not None else None,
                confidential=_confidential(w, node_offers),
            )
        )
    return Assignments(
        node=caller.node_name,
        index=agent.desired_index,
        assignments=out,
        heartbeat_s=heartbeat,
        burn_in=suite.wire(burn) if burn is not None else None,
        mig_layouts=mig.wanted(session, caller.node_id),
    )


def _env(
    w: Workload, a: Allocation, gpus: list[str], local: list[int], masters, agent, caller, settings
) -> dict[str, str]:
    """A run's environment as the control plane sets it: its devices, its rank in its gang
    (torchrun's and TorchElastic's names too), where it resumes from and its array index."""
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(gpus),
        "NVIDIA_VISIBLE_DEVICES": ",".join(gpus),
        "RANK": str(a.replica),
        "WORLD_SIZE": str(w.size),
        "LOCAL_RANK": str(local.index(a.replica)),
        "RACKPLANE_WORKLOAD_ID": str(w.id),
        "RACKPLANE_REPLICA": str(a.replica),
        "RACKPLANE_ATTEMPT": str(w.attempts),
        "RACKPLANE_API": settings.public_api_url,
    }
    if w.replicas > 1:
        env["MASTER_ADDR"] = masters.get(w.id, agent.address)
        env["MASTER_PORT"] = str(w.master_port or _fallback_port(w, settings.master_ports))
        # What a torchrun (TorchElastic) worker finds: one process per replica, this
        # node's replicas a group, the attempt its restart count.
        env.update(
            LOCAL_WORLD_SIZE=str(len(local)),
            GROUP_RANK=str(_group_ranks(w).get(caller.node_name, 0)),
            ROLE_RANK=str(a.replica),
            ROLE_WORLD_SIZE=str(w.size),
            TORCHELASTIC_RESTART_COUNT=str(w.attempts),
            TORCHELASTIC_RUN_ID=str(w.id),
        )
    if w.last_checkpoint_uri:
        env["RACKPLANE_RESUME_FROM"] = w.last_checkpoint_uri
    if w.array_id is not None:  # a job array's element (Slurm's SLURM_ARRAY_TASK_ID)
        env["RACKPLANE_ARRAY_ID"] = str(w.array_id)
        env["RACKPLANE_ARRAY_INDEX"] = str(w.array_index)
        env["RACKPLANE_ARRAY_COUNT"] = str(w.array_count)
    return env


def _serves(session: Session, endpoint_ids: set[uuid.UUID]) -> dict[uuid.UUID, Serve]:
    """What each of these inference endpoints' replicas serves on (app/endpoints)."""
    if not endpoint_ids:
        return {}
    rows = session.execute(
        select(Endpoint.id, Endpoint.port, Endpoint.ready_path).where(Endpoint.id.in_(endpoint_ids))
    )
    return {i: Serve(port=port, ready_path=path) for i, port, path in rows}


class RunNotStartable(Conflict):
    code = "run_not_startable"


def run_env(
    session: Session, caller: NodeCaller, workload_id: uuid.UUID, attempt: int, replica: int
) -> RunEnv:
    """The secret part of a run's environment (the workload's `env`, the values of the
    secrets its `secret_env` names, its run token), for the node that holds that run now,
    before it has started; a node's credential alone never reads a running workload's
    secrets, nor any run of another node's. A secret it names that is gone (or that the
    runtime cannot pass): 409 `run_refused`, which the agent reports as the run's own failure
    to start."""
    row = session.execute(
        select(Allocation, Workload)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(
            Allocation.node_id == caller.node_id,
            Allocation.workload_id == workload_id,
            Allocation.replica == replica,
            Allocation.released_at.is_(None),
            Workload.state == State.provisioning.value,
            Workload.attempts == attempt,
        )
    ).first()
    if row is None or row[0].run_state is not None:
        raise RunNotStartable(
            "This node does not hold that run, or it has already started: a run's environment "
            "is given once, to the node that starts it.",
        )
    w = row[1]
    try:
        secrets = secret_values(session, w.tenant_id, dict(w.secret_env or {}))
    except SecretUnavailable as exc:
        raise RunRefused(f"it cannot start: {exc.detail}", secret=exc.extra.get("secret")) from None
    if w.runtime == "podman":
        # A container gets its env as `NAME=value` lines (env itself is checked at submission).
        broken = sorted(k for k, v in secrets.items() if "\n" in v or "\r" in v)
        if broken:
            raise RunRefused(
                f"it cannot start: the secret for {', '.join(broken)} holds a line break, which "
                "the podman runtime cannot pass to a container"
            )
    return RunEnv(env={**(w.env or {}), **secrets, "RACKPLANE_TOKEN": mint(w.id, w.attempts)})


class RunRefused(Conflict):
    """The run cannot start, for a reason of the workload's own: its agent reports it
    `failed_to_start` with `fault: workload` and this detail (an agent that does not know the
    code retries, and the start times out: never a run without its environment)."""

    code = "run_refused"


def refreshed(out: Assignments) -> Assignments:
    """A cached answer as it would be read now: a stop's grace is what is left of it."""
    if not any(a.stop_deadline for a in out.assignments):
        return out
    now = utcnow()
    return out.model_copy(
        update={
            "assignments": [
                a.model_copy(update={"grace_s": max(0.0, (a.stop_deadline - now).total_seconds())})
                if a.stop_deadline
                else a
                for a in out.assignments
            ]
        }
    )


def _fallback_port(w: Workload, ports: str) -> int:
    """The port of a gang placed before ports were chosen at placement (migration 0050)."""
    first, last = (int(p) for p in ports.split("-"))
    return first + first_port(w.id, w.attempts, max(1, last - first + 1))


def _group_ranks(w: Workload) -> dict[str, int]:
    """The gang's nodes in the order of their lowest replica: torchrun's node rank
    (`GROUP_RANK`) of each."""
    order: dict[str, int] = {}
    for p in sorted(w.placement or [], key=lambda p: p.get("replica", 0)):
        order.setdefault(p["node"], len(order))
    return order


def _confidential(w: Workload, offers: set[str]) -> Confidential | None:
    """The confidential-computing technology a `confidential-vm` launches with on this node
    (placement put it only where the agent offers one)."""
    if w.tier != Tier.CONFIDENTIAL_VM.label:
        return None
    return "sev-snp" if "sev-snp" in offers else "tdx" if "tdx" in offers else None


def _hold(w: Workload) -> list[str]:
    return ["sleep", str(w.run_for_s)] if w.run_for_s else HOLD


def _masters(session: Session, gangs: set[uuid.UUID]) -> dict[uuid.UUID, str]:
    """The address of the node each gang's replica 0 runs on (its MASTER_ADDR)."""
    if not gangs:
        return {}
    rows = session.execute(
        select(Allocation.workload_id, AgentNode.address)
        .join(AgentNode, AgentNode.node_id == Allocation.node_id)
        .join(Workload, Workload.id == Allocation.workload_id)
        .where(
            Allocation.workload_id.in_(gangs),
            Allocation.replica == 0,
            or_(Allocation.released_at.is_(None), Allocation.released_at >= Workload.evicted_at),
        )
    )
    return {wid: address for wid, address in rows}


def _devices(inventory: dict) -> dict[tuple[int, int | None], str]:
    """The host's devices by (GPU index, MIG start or None for the whole GPU): their UUIDs."""
    out: dict[tuple[int, int | None], str] = {}
    for g in inventory.get("gpus", []):
        out[(g["index"], None)] = g["uuid"]
        for m in g.get("mig_instances") or []:
            if m.get("start") is not None:
                out[(g["index"], m["start"])] = m["uuid"]
    return out


def _device_ids(a: Allocation, devices: dict[tuple[int, int | None], str]) -> list[str]:
    """The allocation's GPUs (or MIG instance) by UUID. One the host did not report is named
    so that the agent refuses the run (and the workload is placed again), never a guess."""
    if a.mig_profile:
        key = (a.gpu_indices[0], a.mig_start)
        return [devices.get(key, f"MIG-missing-{a.gpu_indices[0]}-{a.mig_start}")]
    return [devices.get((i, None), f"GPU-missing-{i}") for i in a.gpu_indices]


# --- reports ------------------------------------------------------------------------------------


def report(session: Session, caller: NodeCaller, status: StatusReport) -> StatusAck:
    """Take an agent's report: a heartbeat, and the runs whose state is news."""
    if status.mig_layouts:  # before its inventory: the GPUs' MIG mode changed with them
        node = session.get(Node, caller.node_id)
        assert node is not None
        mig.take(session, node, status.mig_layouts)
    if status.inventory is not None:  # read again after an upgrade: before it is judged
        inventory.report(session, caller, status.inventory)
    if status.burn_in is not None:
        burnin.take(session, caller.node_id, status.burn_in, utcnow())
    if not status.runs:  # a heartbeat alone
        telemetry.ingest(session, [], {}, heartbeat_nodes=[caller.node_name])
        return StatusAck(accepted=0, stale=0)
    # When the node was last heard before this report: a process the agent lost since (its
    # host restarted) was last known to run then.
    heard = session.scalar(
        select(NodeHeartbeat.last_seen_at).where(NodeHeartbeat.node_id == caller.node_id)
    )
    telemetry.ingest(session, [], {}, heartbeat_nodes=[caller.node_name])
    reported: dict[tuple[uuid.UUID, int], RunReport] = {}
    stale = 0
    for r in status.runs:
        try:
            reported[(uuid.UUID(r.workload_id), r.replica)] = r
        except ValueError:
            stale += 1
    wids = sorted({wid for wid, _ in reported})
    # Workloads first, in id order (the lock order of every task), then their allocations.
    ws = {
        w.id: w
        for w in session.scalars(
            select(Workload).where(Workload.id.in_(wids)).order_by(Workload.id).with_for_update()
        )
    }
    rows = session.execute(
        _held(caller.node_id).where(Allocation.workload_id.in_(wids)).with_for_update(of=Allocation)
    ).all()
    now = utcnow()
    matched: set[tuple[uuid.UUID, int]] = set()
    news: set[uuid.UUID] = set()
    for a, w in rows:
        r = reported.get((w.id, a.replica))
        if r is None or r.attempt != w.attempts:
            continue
        matched.add((w.id, a.replica))
        if _take(a, r, now):
            news.add(w.id)
        if r.ssh_port is not None and r.state == "running":
            _take_ssh(session, caller, w, r, now)
        if r.serve_port is not None and r.state == "running" and w.endpoint_id is not None:
            _take_serve(session, caller, w, r, now)
    stale += len(reported) - len(matched)
    tails = {
        (uuid.UUID(r.workload_id), r.replica): r
        for r in status.runs
        if r.tail or r.message or r.fault
    }
    for wid in sorted(news):
        _settle(session, ws[wid], tails, as_aware(heard) if heard else now)
    return StatusAck(accepted=len(matched), stale=stale)


def _take_ssh(
    session: Session, caller: NodeCaller, w: Workload, r: RunReport, now: datetime
) -> None:
    """Where a running instance's SSH server is (the node's address, the port its agent
    picked), and when it first answered."""
    if w.ssh_port != r.ssh_port or w.ssh_host is None:
        w.ssh_port = r.ssh_port
        w.ssh_host = session.scalar(
            select(AgentNode.address).where(AgentNode.node_id == caller.node_id)
        )
        w.ssh_ready_at = None
    if r.ssh_ready and w.ssh_ready_at is None:
        w.ssh_ready_at = now
        lifecycle.record(
            session,
            w,
            kind="ready",
            from_state=w.state,
            to_state=w.state,
            reason=f"its SSH server answers: ssh -p {w.ssh_port} root@{w.ssh_host}",
            details={"host": w.ssh_host, "port": w.ssh_port},
            at=now,
        )


def _take_serve(
    session: Session, caller: NodeCaller, w: Workload, r: RunReport, now: datetime
) -> None:
    """Where a running endpoint replica serves (the node's address, the port its agent
    published), and when its readiness path first answered: from then the gateway routes
    to it."""
    if w.serve_port != r.serve_port or w.serve_host is None:
        w.serve_port = r.serve_port
        w.serve_host = session.scalar(
            select(AgentNode.address).where(AgentNode.node_id == caller.node_id)
        )
        w.serve_ready_at = None
    if r.serve_ready and w.serve_ready_at is None:
        w.serve_ready_at = now
        lifecycle.record(
            session,
            w,
            kind="ready",
            from_state=w.state,
            to_state=w.state,
            reason=f"it answers its readiness path at {w.serve_host}:{w.serve_port}",
            details={"host": w.serve_host, "port": w.serve_port},
            at=now,
        )


def _clamp(at: datetime, low: datetime | None, now: datetime) -> datetime:
    at = min(as_aware(at), now)
    return max(at, as_aware(low)) if low is not None else at


def _take(a: Allocation, r: RunReport, now: datetime) -> bool:
    """Record what the report says of the run, if it is news; whether it was."""
    if a.run_state in FAILED_RUNS:
        return False  # an ended run stays ended
    if r.state == "running":
        if a.run_state == "running":
            return False
        a.run_state, a.run_pid = "running", r.pid
        a.run_started_at = _clamp(r.at, a.created_at, now)
        return True
    a.run_state = "exited" if r.state == "exited" else r.state
    a.exit_code = r.exit_code
    a.exit_signal = ("STOPPED:" if r.stopped else "") + (r.signal or "") or None
    a.run_started_at = a.run_started_at or _clamp(r.at, a.created_at, now)
    a.run_ended_at = _clamp(r.at, a.run_started_at, now)
    return True


def _failure(a: Allocation) -> bool:
    """A run that ended badly by itself (not an exit the control plane asked for)."""
    if a.run_state not in FAILED_RUNS:
        return False
    stopped = (a.exit_signal or "").startswith("STOPPED:")
    return not stopped and not (a.run_state == "exited" and a.exit_code == 0)


def _settle(
    session: Session,
    w: Workload,
    tails: dict[tuple[uuid.UUID, int], RunReport],
    heard: datetime,
) -> None:
    """What the workload's runs, as now recorded, mean for it (`heard`: when their node was
    last heard before this report): its start, a lost run, a failed one, or the end of all."""
    allocs = [a for a, _ in session.execute(_held().where(Allocation.workload_id == w.id)).all()]
    if w.state == State.provisioning.value and _settle_start(session, w, allocs, tails):
        return
    if w.state not in (State.running.value, State.checkpointing.value):
        return
    if _settle_lost(session, w, allocs, tails, heard) or _settle_failed(session, w, allocs, tails):
        return
    _settle_ended(session, w, allocs)


def _settle_start(
    session: Session, w: Workload, allocs: list, tails: dict[tuple[uuid.UUID, int], RunReport]
) -> bool:
    """A provisioning workload: failed (it cannot start anywhere), back to the queue (a start
    that went wrong), still starting, or running now. True when there is nothing more to do."""
    own = [
        a
        for a in allocs
        if a.run_state == "failed_to_start"
        and (r := tails.get((w.id, a.replica))) is not None
        and r.fault == "workload"
    ]
    if own:
        # It cannot start anywhere (its command is not there): failed now, with why,
        # rather than placed again and again. It never ran: its allocations end when they
        # began, so nothing of it is billed.
        a = own[0]
        r = tails[(w.id, a.replica)]
        held = release_unstarted(session, w, reason="failed_to_start")
        lifecycle.transition(
            session,
            w,
            State.failed,
            f"replica {a.replica} could not start: {r.message}",
            {"cause": "failed_to_start", "replica": a.replica, "message": r.message},
        )
        if held:  # its other replicas stop; its GPUs go to the queue
            wid = str(w.id)
            enqueue(session, "workloads.deprovision", queue="provisioning", workload_id=wid)
            kick_placement(session, w.region)
        return True
    crashed = [a for a in allocs if a.run_state == "exited" and _failure(a)]
    if crashed:
        # A process that ran and exited badly by itself before its last replica came up
        # (a crash at start-up): the workload's own failure, not a start that went wrong.
        # It ran from its first replica's start; its policy decides below, as for any
        # failure, and its usage runs until the crash.
        began = min(as_aware(a.run_started_at) for a in allocs if a.run_started_at)
        workload_runs.start(session, [w], began, get_provider(session))
    elif any(_failure(a) for a in allocs):
        # A start that went wrong: `workloads.check` puts it back in the queue, at once.
        enqueue(session, "workloads.check", queue="provisioning", workload_ids=[str(w.id)])
        return True
    elif not allocs or any(a.run_state is None for a in allocs):
        return True  # replicas still starting
    else:
        # Every replica is up (or already done): it runs from when the last one started.
        began = max(as_aware(a.run_started_at) for a in allocs)
        workload_runs.start(session, [w], began, get_provider(session))
    return False


def _settle_lost(
    session: Session,
    w: Workload,
    allocs: list,
    tails: dict[tuple[uuid.UUID, int], RunReport],
    heard: datetime,
) -> bool:
    """A run lost with its host: the workload goes back to the queue as from a hardware
    fault. True when it did."""
    lost = [a for a in allocs if a.run_state == "lost" and _failure(a)]
    if lost and w.state == State.running.value:
        # Its process vanished with its host (a reboot, a power cut): not the workload's fault.
        # It goes back to the queue from its checkpoint, as from any hardware fault.
        a = min(lost, key=lambda a: as_aware(a.run_ended_at))
        r = tails.get((w.id, a.replica))
        # Its usage ends when it was last known to run, not when the agent came back.
        at = max(min(as_aware(a.run_ended_at), heard), as_aware(a.run_started_at))
        agent = r is not None and r.fault == "agent"
        interrupt_on_fault(
            session,
            session.get_one(Node, a.node_id),
            list(a.gpu_indices),
            "gpu",
            at,
            f"its node's agent could not record replica {a.replica}'s exit (the agent's "
            "failure, not the workload's or its GPUs')"
            if agent
            else f"replica {a.replica}'s process was lost on its node (the host restarted?)",
            {
                "replica": a.replica,
                "message": r.message if r else None,
                "fault": "agent" if agent else "host",
            },
            only={w.id},
            hardware=not agent,
        )
        return True
    return False


def _settle_failed(
    session: Session, w: Workload, allocs: list, tails: dict[tuple[uuid.UUID, int], RunReport]
) -> bool:
    """A replica that ended badly by itself: the workload's failure (once its gang's other
    hosts have had their say). True when there was one."""
    # (A run lost in its grace, its node gone while it checkpointed, is one more that stopped:
    # its workload was on its way off, and goes back to the queue as its preemption said.)
    failed = sorted(
        (a for a in allocs if _failure(a) and a.run_state != "lost"), key=lambda a: a.run_ended_at
    )
    if failed:
        a = failed[0]
        r = tails.get((w.id, a.replica))
        code = f"code {a.exit_code}" if a.exit_code is not None else a.exit_signal or a.run_state
        reason = f"replica {a.replica}'s process {_ended(a)} ({code}) on its node"
        details = {
            "cause": "exited_nonzero" if a.run_state == "exited" else a.run_state,
            "replica": a.replica,
            "exit_code": a.exit_code,
            "signal": a.exit_signal,
            "tail": list(r.tail[-TAIL_IN_EVENT:]) if r else [],
            "message": r.message if r else None,
        }
        if r is None:  # reported earlier, while its peers were waited for: as it was then
            details = _first_report(session, w, a.replica) or details
        at = as_aware(a.run_ended_at)
        if unheard_peers(allocs):
            if len(failed) == 1:  # its first failure: the gang's other hosts are asked once
                _await_peers(session, w, reason, at, details)
            return True
        end_in_failure(session, w, reason=reason, at=at, details=details)
        return True
    return False


def _settle_ended(session: Session, w: Workload, allocs: list) -> None:
    """Every replica ended: succeeded (all exited 0 by themselves), or a preemption whose
    victims all stopped within their grace."""
    ended = [a for a in allocs if a.run_state in FAILED_RUNS]
    if allocs and len(ended) == len(allocs):
        if all(a.run_state == "exited" and a.exit_code == 0 for a in ended) and not any(
            (a.exit_signal or "").startswith("STOPPED:") for a in ended
        ):
            last = max(as_aware(a.run_ended_at) for a in ended)
            finish(
                session,
                w,
                succeeded=True,
                reason="every replica's process exited with code 0",
                at=last,
                details={"exit_code": 0, "cause": "exited"},
            )
        elif w.state == State.checkpointing.value:
            # Every replica stopped within its grace: its preemptor need not wait for the end.
            enqueue(
                session,
                "workloads.finish_preemption",
                queue="provisioning",
                workload_id=str(w.id),
                all_stopped=True,
            )


def unheard_peers(allocs: list[Allocation]) -> set[uuid.UUID]:
    """The nodes of a gang spread over several whose replicas all still run (as last
    reported; not those yet to start) while a replica elsewhere ended: one of them may be gone
    with its host, and a peer's exit (NCCL or Gloo losing its connection) would then be the
    host's fault, not the workload's."""
    if len({a.node_id for a in allocs}) < 2:
        return set()
    ended = {a.node_id for a in allocs if a.run_state in FAILED_RUNS}
    return {a.node_id for a in allocs if a.run_state == "running"} - ended


def _await_peers(session: Session, w: Workload, reason: str, at: datetime, details: dict) -> None:
    """A replica of a gang failed while hosts of its other replicas have said nothing since:
    judged once they have had time to (`agents.judge_gang`), rather than now, so that a
    host's loss (which its peers notice first) is not billed as the workload's failure."""
    interval = get_settings().heartbeat_timeout_seconds / 3
    lifecycle.record(
        session,
        w,
        kind="judging",
        from_state=w.state,
        to_state=w.state,
        reason=f"{reason}; waiting for its gang's other hosts before judging it",
        details={**details, "attempt": w.attempts, "wait_s": round(SILENT_BEATS * interval, 3)},
    )
    enqueue(
        session,
        "agents.judge_gang",
        queue="provisioning",
        countdown=min(JUDGE_POLL_S, interval),
        workload_id=str(w.id),
        attempt=w.attempts,
        reason=reason,
        at=at.isoformat(),
        details=details,
    )


def _first_report(session: Session, w: Workload, replica: int) -> dict | None:
    """What was reported of `replica`'s failure when its gang's other hosts were waited for."""
    details = session.scalar(
        select(WorkloadEvent.details)
        .where(WorkloadEvent.workload_id == w.id, WorkloadEvent.kind == "judging")
        .order_by(WorkloadEvent.seq.desc())
        .limit(1)
    )
    if not details or (details.get("replica"), details.get("attempt")) != (replica, w.attempts):
        return None
    return {k: v for k, v in details.items() if k not in ("wait_s", "attempt")}


def judge_gang(
    session: Session,
    workload_id: uuid.UUID,
    attempt: int,
    reason: str,
    at: datetime,
    details: dict,
) -> str:
    """A gang's replica failed at `at` while hosts of its other replicas had said nothing since.
    A host whose last heartbeat is older than a live agent's ever is (`SILENT_BEATS` intervals)
    is reported lost now, before the heartbeat timeout (its peer's error corroborates the
    silence; `health.evaluate` interrupts the gang, which resumes from its
    checkpoint, not billed as its own failure); one not yet due is waited for. Once every
    host has reported since the failure, or after twice the heartbeat timeout, the failure is
    the workload's own."""
    w = session.scalar(select(Workload).where(Workload.id == workload_id).with_for_update())
    if w is None or w.state != State.running.value or w.attempts != attempt:
        return "moved on"
    settings = get_settings()
    interval = settings.heartbeat_timeout_seconds / 3
    now = utcnow()
    allocs = [a for a, _ in session.execute(_held().where(Allocation.workload_id == w.id)).all()]
    peers = unheard_peers(allocs)
    seen = {
        n: as_aware(t)
        for n, t in session.execute(
            select(NodeHeartbeat.node_id, NodeHeartbeat.last_seen_at).where(
                NodeHeartbeat.node_id.in_(peers)
            )
        )
    }
    quiet = {n: t for n, t in seen.items() if t <= at}  # not heard since the failure
    if quiet and now - at < 2 * settings.heartbeat_timeout_seconds * SEC:
        # A live agent's heartbeat is written at least every two intervals (each report a
        # heartbeat apart; one written at most every interval): past that, it is silent.
        silent = {n: t for n, t in quiet.items() if now - t > SILENT_BEATS * interval * SEC}
        for node_id, last in sorted(silent.items()):
            report_silence(session, node_id, last, now)
        # Judged again soon: a quiet host's next report (each comes a heartbeat apart) or
        # its silence settles it; a heartbeat after the silent ones were reported lost.
        wait = interval if silent else min(JUDGE_POLL_S, interval)
        enqueue(
            session,
            "agents.judge_gang",
            queue="provisioning",
            countdown=wait,
            workload_id=str(w.id),
            attempt=attempt,
            reason=reason,
            at=at.isoformat(),
            details=details,
        )
        return "silent peers" if silent else "waiting"
    end_in_failure(session, w, reason=reason, at=at, details=details)
    return "failed"


def _ended(a: Allocation) -> str:
    return {"exited": "exited", "failed_to_start": "failed to start", "lost": "was lost"}.get(
        a.run_state or "", "ended"
    )
