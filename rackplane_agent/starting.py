"""Starting a run: whether this node can start it at all, the secret env it fetches first, the
node's ports it is reached on (SSH, serving), its launch by its runtime, and what a start that
failed leaves for the customer to read.

The reconciler (`Agent._start`) calls these in that order, under the agent's lock. Each takes
what it reads and changes as arguments, so the rules of a start read without the rest of the
agent: a start that cannot happen ends the run as `failed_to_start`, with why in its message
and in its output.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Iterable, Mapping

from rackplane_agent import runtimes, sshports
from rackplane_agent.client import ApiError, Client, CredentialRefused, TransientError
from rackplane_agent.config import AgentConfig
from rackplane_agent.logfmt import kv
from rackplane_agent.runusers import RunUsers
from rackplane_agent.state import FAILED_TO_START, RUNNING, RunRecord, StateDir, run_key
from rackplane_agent.volumes import Volumes
from rackplane_wire import Assignment

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")


def new_record(a: Assignment, state: StateDir) -> RunRecord:
    """The record of a run about to start, in a run directory of its own (0700)."""
    run_dir = state.run_dir(a.workload_id, a.attempt, a.replica)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return RunRecord(
        workload_id=a.workload_id,
        attempt=a.attempt,
        replica=a.replica,
        assignment=a.model_dump(mode="json"),
        grace_s=a.grace_s,
        checkpoints_sent=a.checkpoint_requests,
        run_dir=run_dir,
    )


def refusal(
    a: Assignment,
    rec: RunRecord,
    offered: Mapping[str, runtimes.Runtime],
    runtime_names: list[str],
    device_ids: Collection[str],
) -> str | None:
    """Why the run cannot start here, if it cannot (`rec.fault`: whose that is)."""
    if a.runtime not in offered:
        return (
            f"runtime {a.runtime} is not available on this node "
            f"(it has: {', '.join(runtime_names)})"
        )
    missing = [d for d in a.devices if d not in device_ids]
    if missing:
        return f"device(s) not on this node: {', '.join(missing)}"
    try:
        offered[a.runtime].check(a)
    except runtimes.StartError as exc:
        if isinstance(exc, runtimes.WorkloadStartError):
            rec.fault = "workload"
        return str(exc)
    return None


def secret_env(
    client: Client, a: Assignment, retry_at: dict[str, float], retry_s: float
) -> tuple[dict[str, str], str | None] | None:
    """The run's secret env, fetched as it starts, and why it cannot start if the control
    plane refuses it (`run_refused`: the workload's own doing); None: not now (try again
    after `retry_s`, kept per run in `retry_at`)."""
    if not a.fetch_env:
        return {}, None
    key = run_key(a.workload_id, a.attempt, a.replica)
    if time.monotonic() < retry_at.get(key, 0.0):
        return None
    try:
        env = client.run_env(a.workload_id, a.attempt, a.replica).env
    except CredentialRefused:
        return None  # the sync loop stops the agent
    except ApiError as exc:
        if exc.code == "run_refused":
            retry_at.pop(key, None)
            return {}, exc.detail
        retry_at[key] = time.monotonic() + retry_s
        log.warning(kv("run_env_unavailable", run=key, error=exc))
        return None
    except TransientError as exc:
        retry_at[key] = time.monotonic() + retry_s
        log.warning(kv("run_env_unavailable", run=key, error=exc))
        return None
    retry_at.pop(key, None)
    return env, None


def claim_ports(
    a: Assignment,
    runs: Collection[RunRecord],
    offered: Mapping[str, runtimes.Runtime],
    state: StateDir,
    config: AgentConfig,
    serve_after: int | None,
) -> tuple[int | None, int | None, str | None]:
    """The node's SSH and serving ports for the run (None: it needs none), or why there is no
    free one."""
    # The SSH port is the agent's to choose, whatever the assignment says.
    port = None
    if a.ssh_keys and offered[a.runtime].serves_ssh:
        port = pick_ssh_port(runs, offered, state, config.ssh_ports)
        if port is None:
            first, last = config.ssh_ports
            problem = (
                f"no free SSH port on this node: each of {first}-{last} (--ssh-ports) is "
                "held by a run or in use on the host"
            )
            return None, None, problem
    serve_port = None
    if a.serve is not None:
        serve_port = pick_serve_port(runs, config.serve_ports, serve_after)
        if serve_port is None:
            first, last = config.serve_ports
            problem = (
                f"no free serving port on this node: each of {first}-{last} (--serve-ports) "
                "is held by a run or in use on the host"
            )
            return port, None, problem
    return port, serve_port, None


def pick_ssh_port(
    runs: Iterable[RunRecord],
    offered: Mapping[str, runtimes.Runtime],
    state: StateDir,
    ports: tuple[int, int],
) -> int | None:
    """A port of `--ssh-ports` for a run starting now (`sshports.pick`), or None: one no
    live run holds, no runtime's plumbing forwards (a stale DNAT rule of netavark's would
    catch its traffic), free on the host, in turn after the last one handed out (kept in
    the state directory, so an agent restarted goes on from there)."""
    held = {r.ssh_port for r in runs if r.state == RUNNING and r.ssh_port}
    forwarded = {p for rt in offered.values() for p in rt.forwarded_ports()}
    skipped = sorted(p for p in forwarded - held if ports[0] <= p <= ports[1])
    if skipped:
        log.info(kv("ssh_ports_forwarded", ports=",".join(map(str, skipped[:20]))))
    port = sshports.pick(ports, held | forwarded, state.read_ssh_port())
    if port is not None:
        state.write_ssh_port(port)
    return port


def pick_serve_port(
    runs: Iterable[RunRecord], ports: tuple[int, int], after: int | None
) -> int | None:
    """A port of `--serve-ports` for a serving run starting now: one no live run holds,
    free on the host, in turn after `after` (the last one handed out)."""
    held = {r.serve_port for r in runs if r.state == RUNNING and r.serve_port}
    return sshports.pick(ports, held, after)


def run_env(
    a: Assignment, data_interface: str | None, serve_port: int | None = None
) -> dict[str, str]:
    """The assignment's env with what this host adds: the interface a gang's hosts reach
    each other on, and the port a serving run listens on: the node's own for a process,
    the endpoint's inside a container (the run's own env, fetched as it starts, still
    wins)."""
    added: dict[str, str] = {}
    if data_interface and "MASTER_ADDR" in a.env:
        added |= {"NCCL_SOCKET_IFNAME": data_interface, "GLOO_SOCKET_IFNAME": data_interface}
    if a.serve is not None and serve_port is not None:
        added["PORT"] = str(serve_port if a.runtime == "process" else a.serve.port)
    return {**added, **a.env}


def launch(
    rec: RunRecord,
    a: Assignment,
    secret: dict[str, str],
    *,
    runs: Iterable[RunRecord],
    runtime: runtimes.Runtime,
    users: RunUsers,
    volumes: Volumes,
    ssh_port: int | None,
    serve_port: int | None,
    data_interface: str | None,
    now: float,
) -> str | None:
    """Start the run by its runtime, as its own user with its volumes mounted, reached on
    the node's `ssh_port` and `serve_port`; why not, if it could not start."""
    rec.exit_file.unlink(missing_ok=True)
    try:
        in_use = {r.uid for r in runs if r.uid is not None}
        place = users.take(rec.run_dir.name, in_use, a.run_gid, runtime.own_uid)
        rec.uid = place.user.uid if place.user else None
        rec.workdir = str(place.workdir)
        if a.volumes:
            mounted = volumes.host_dirs(a, place.user)
            place = dataclasses.replace(place, volumes=tuple(mounted))
        rec.ssh_port, rec.serve_port = ssh_port, serve_port
        started = a.model_copy(
            update={
                "ssh_port": ssh_port,
                "serve_port": serve_port,
                "env": run_env(a, data_interface, serve_port),
            }
        )
        runtime.start(rec, started, secret, place)
    except (runtimes.StartError, OSError) as exc:
        rec.ssh_port = rec.serve_port = None
        if isinstance(exc, runtimes.WorkloadStartError):
            rec.fault = "workload"
        return str(exc)
    rec.started_at = now
    log.info(
        kv(
            "run_started",
            run=rec.key,
            pid=rec.pid,
            runtime=a.runtime,
            uid=rec.uid,
            devices=",".join(a.devices) or None,
            ssh_port=rec.ssh_port,
            serve_port=rec.serve_port,
        )
    )
    return None


def record_failed_start(rec: RunRecord, now: float, problem: str) -> None:
    """End the run as `failed_to_start`, with why in its message and its output."""
    rec.state = FAILED_TO_START
    rec.ended_at = now
    rec.message = problem[:2000]
    log.warning(kv("run_failed_to_start", run=rec.key, reason=problem))
    try:  # the customer reads why in the workload's logs, not only in its events
        with open(rec.output, "ab") as out:
            out.write(f"rackplane-agent: the run could not start: {problem}\n".encode())
    except OSError:
        pass
