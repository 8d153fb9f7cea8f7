"""The agent: join, inventory, then the sync loop (Nomad's client, in small).

Threads:
- sync: checks the credential (`GET /node`), puts the inventory, then long-polls
  `GET /assignments` and keeps the latest `Assignments` (the node's whole desired state);
- reporter: `POST /status` (at once when something changed, else a heartbeat) and
  `POST /logs` (new output, about once a second);
- telemetry: dcgm-exporter's text, or NVML's samples, every 10 s;
- main: the reconciler, every `reconcile_interval` or when woken: starts, stops, kills,
  checkpoints and watches runs; forgets a run once its end is acknowledged and nobody names it.

An instance one logs into (a `podman` or `vm` run with SSH keys) gets a port of the node from
`--ssh-ports` as it starts (`sshports.pick`), kept in its run.json; the reporter knocks on it
(each unready run at most every SSH_PROBE_INTERVAL, all at once, SSH_PROBE_TIMEOUT in all) until
an SSH server greets, and reports it ready.

Nothing the control plane says or fails to say kills a run by itself: a refused credential, an
unreachable server, the agent's own restart all leave the runs running. Every run is watched
by polling (its shim's pid and create time, and its exit file), so a run started by an earlier
agent process is adopted like one of this one's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal, cast

from rackplane_agent import inventory as inventory_mod
from rackplane_agent import logs as logs_mod
from rackplane_agent import runtimes, serving, sshports
from rackplane_agent.burnin import BurnInRunner
from rackplane_agent.cgroups import Cgroups
from rackplane_agent.client import (
    ApiError,
    Backoff,
    Client,
    CredentialRefused,
    JoinRefused,
    RouteMissing,
    TransientError,
)
from rackplane_agent.config import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_REVOKED,
    EXIT_USAGE,
    AgentConfig,
)
from rackplane_agent.logfmt import kv
from rackplane_agent.mig import MigApplier
from rackplane_agent.runusers import RunUsers, WorkDirError
from rackplane_agent.shim import signal_name
from rackplane_agent.state import (
    RunRecord,
    StateDir,
    StateDirBusy,
    iso,
    run_key,
)
from rackplane_agent.volumes import Volumes
from rackplane_wire import (
    Assignment,
    Assignments,
    Inventory,
    LogBatch,
    LogChunk,
    RunReport,
    RunState,
    StatusReport,
)

log = logging.getLogger("rackplane_agent")

RUNNING, EXITED, FAILED_TO_START, LOST = "running", "exited", "failed_to_start", "lost"
# How often, at most, the agent writes down that it saw its runs alive (StateDir.mark_alive):
# what a run found gone after a power cut is billed to, at worst this much short.
ALIVE_MARK_S = 1.0
LOG_BATCH_BYTES = 512 * 1024
SSH_PROBE_INTERVAL = 0.5  # seconds between two knocks on one run's SSH port
SSH_PROBE_TIMEOUT = 0.5  # what one round of knocks (every unready run at once) may take
SERVE_PROBE_INTERVAL = 0.25  # seconds between two GETs of a serving run's readiness path
SERVE_PROBE_TIMEOUT = 0.5


class StartupError(Exception):
    """The agent cannot start (exit 2): no token, no inventory, a busy state directory."""


def parse_signal(name: str) -> signal.Signals | None:
    """`SIGUSR1`, `USR1` or `10` -> the signal; None when it is none."""
    name = name.strip().upper()
    if name.isdigit():
        try:
            return signal.Signals(int(name))
        except ValueError:
            return None
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        return None


def _parse_iso(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        client: Client | None = None,
        *,
        inventory: Inventory | None = None,
        nvml: Any | None = None,
        clock: Callable[[], float] = time.time,
        environ: dict[str, str] | None = None,
    ):
        self.config = config
        self.state = StateDir(config.state_dir)
        self.client = client or Client(
            config.api,
            timeout=config.request_timeout,
            backoff_initial=config.backoff_initial,
            backoff_max=config.backoff_max,
        )
        self.inventory = inventory
        self.clock = clock
        self._nvml = nvml
        self._environ = os.environ if environ is None else environ
        self._lock = threading.RLock()
        self._wake = threading.Event()  # the reconciler: new assignments, or shutdown
        self._report_wake = threading.Event()  # the reporter: something changed
        self._stop = threading.Event()
        self._inventory_sent = threading.Event()
        self._fatal: BaseException | None = None
        self._runs: dict[str, RunRecord] = {}
        self._assignments: Assignments | None = None
        self._heartbeat_s = config.heartbeat_s
        self._alive_marked = float("-inf")
        self._last_report_ok: float | None = None  # monotonic
        self._next_report_at = 0.0
        self._report_backoff = Backoff(config.backoff_initial, config.backoff_max)
        self._logs_enabled = True
        self._next_logs_at = 0.0
        self._logs_backoff = Backoff(config.backoff_initial, config.backoff_max)
        self._logs_budget = LOG_BATCH_BYTES
        self._runtime_names: list[str] = []
        self._runtimes: dict[str, runtimes.Runtime] = {}
        self._shim = runtimes.ShimRuntime()
        self._device_ids: set[str] = set()
        self._cgroups = Cgroups() if config.cgroups else None
        assert config.work_dir is not None
        self._users = RunUsers(
            config.work_dir, config.uid_range(os.geteuid()), owner=config.state_dir
        )
        assert config.volumes_dir is not None
        self._volumes = Volumes(
            config.volumes_dir, config.shared_volumes_dir, self._users.isolating
        )
        self._env_retry_at: dict[str, float] = {}  # a run whose env could not be fetched
        self._prepared = False
        self._threads: list[threading.Thread] = []
        self._burnin: BurnInRunner | None = None
        self._mig: MigApplier | None = None
        self._ssh_next_probe: dict[str, float] = {}  # run -> when to knock again (monotonic)
        self._serve_next_probe: dict[str, float] = {}  # run -> when to GET its ready path again
        self._serve_after: int | None = None  # the serving port handed out last

    # --- start -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Everything local: the state directory (locked), the inventory, the runs found in
        it. Raises StartupError."""
        if self._prepared:
            return
        self.state.ensure()
        try:
            self.state.lock()
        except StateDirBusy as exc:
            raise StartupError(str(exc)) from None
        try:
            self.state.sweep_launch_files()
            self._runtime_names = runtimes.available(self.config.runtimes)
            self._users.prepare(self.state.root)
            self._volumes.prepare()
        except (ValueError, WorkDirError, OSError) as exc:
            raise StartupError(str(exc)) from None
        if not self._users.isolating:
            log.warning(
                kv(
                    "runs_share_agent_user",
                    detail="every process run runs as this agent's user, which can read its "
                    "state: a single-user machine only (run the agent as root for a uid per run)",
                )
            )
        max_output = self.config.max_output_mib * 1024 * 1024
        self._runtimes = {
            name: runtimes.make(
                name, self._environ, max_output, self._cgroups, state_dir=self.state.root
            )
            for name in self._runtime_names
        }
        if self.inventory is None:
            if self._nvml is None:
                self._nvml = inventory_mod.load_nvml()
            try:
                self.inventory = inventory_mod.collect(
                    inventory_file=self.config.inventory_file,
                    address=self.config.address,
                    runtimes=self._runtime_names,
                    nvml=self._nvml,
                )
            except inventory_mod.InventoryError as exc:
                raise StartupError(str(exc)) from None
        # MIG layouts need nvidia-smi to change them and NVML to read the result back.
        self._mig = MigApplier(
            self.state.root / "mig",
            self._nvml if self.inventory.source == "nvml" else None,
            environ=self._environ,
        )
        self.inventory = self._capable(self.inventory)
        self._device_ids = inventory_mod.device_ids(self.inventory)
        for runtime in self._runtimes.values():
            runtime.use_inventory(self.inventory)  # a VM's GPUs by PCI bus id
        self._burnin = BurnInRunner(
            self.state.root / "burn-in", [g.uuid for g in self.inventory.gpus]
        )
        log.info(
            kv(
                "inventory",
                source=self.inventory.source,
                gpus=len(self.inventory.gpus),
                mig_instances=sum(len(g.mig_instances) for g in self.inventory.gpus),
                hostname=self.inventory.hostname,
                address=self.inventory.address,
                runtimes=",".join(self.inventory.runtimes),
            )
        )
        self._scan()
        self._prepared = True

    def connect(self) -> None:
        """The node credential: the stored one, else a join with the token. Raises
        StartupError (no token, a refused token)."""
        credential = self.state.read_credential()
        if credential:
            self.client.credential = credential
            node = self.state.read_node()
            log.info(kv("credential_loaded", node=node.get("node_name"), state_dir=self.state.root))
            return
        if not self.config.token:
            raise StartupError(
                f"this node has not joined (no {self.state.credential_file}) and no join token "
                "was given: pass --token rpj_... or set RACKPLANE_JOIN_TOKEN"
            )
        try:
            joined = self.client.join(self.config.token, attempts=None, stop_event=self._stop)
        except JoinRefused as exc:
            raise StartupError(f"the join token was refused: {exc.code} {exc.detail}") from None
        except TransientError as exc:
            raise StartupError(f"cannot reach {self.config.api} to join: {exc}") from None
        except ApiError as exc:
            raise StartupError(f"join failed: {exc}") from None
        node = {k: joined.get(k) for k in ("node_id", "node_name", "credential_prefix")}
        self.state.write_credential(joined["credential"], {**node, "joined_at": iso(time.time())})
        log.info(
            kv(
                "joined",
                node=node["node_name"],
                node_id=node["node_id"],
                credential_prefix=node["credential_prefix"],
            )
        )

    def _scan(self) -> None:
        """Runs left by an earlier agent: adopted when their process lives on, else ended (one
        gone without an exit record: when the earlier agent last saw it alive)."""
        seen = self.state.seen_alive()
        for run_dir in self.state.run_dirs():
            try:
                rec = RunRecord.load(run_dir)
            except (OSError, ValueError, TypeError) as exc:
                log.error(kv("run_unreadable", dir=run_dir, error=exc))
                continue
            self._runs[rec.key] = rec
            if rec.state != RUNNING:
                continue
            if self._driver(rec).recover(rec):
                log.info(kv("run_adopted", run=rec.key, pid=rec.pid))
            else:
                self._ended(rec, self.clock(), while_down=True, seen_alive=seen)

    # --- the desired state -----------------------------------------------------------------

    def set_assignments(self, assignments: Assignments) -> None:
        with self._lock:
            self._assignments = assignments
            self._heartbeat_s = assignments.heartbeat_s
        self._wake.set()

    @property
    def runs(self) -> dict[str, RunRecord]:
        with self._lock:
            return dict(self._runs)

    # --- the reconciler --------------------------------------------------------------------

    def step(self) -> None:
        """One pass: reconcile, knock on SSH and serving ports not answering yet, then report
        (when due)."""
        self.reconcile()
        self.check_ssh()
        self.check_serving()
        self.report()

    def reconcile(self) -> None:
        with self._lock:
            now = self.clock()
            alive = False
            for rec in list(self._runs.values()):
                if rec.state == RUNNING:
                    if self._driver(rec).running(rec):
                        alive = True
                    else:
                        self._ended(rec, now)
            # Paced on the monotonic clock: a wall clock stepped back must not stop the marks.
            tick = time.monotonic()
            if alive and tick - self._alive_marked >= ALIVE_MARK_S:
                self._alive_marked = tick
                try:
                    self.state.mark_alive(now)
                except OSError as exc:  # a full or read-only disk: the runs go on regardless
                    log.warning(kv("alive_mark_failed", error=exc))
            desired = self._assignments
            if desired is not None:
                named: dict[str, Assignment] = {}
                for a in desired.assignments:
                    named[run_key(a.workload_id, a.attempt, a.replica)] = a
                for key, a in named.items():
                    known = self._runs.get(key)
                    if known is None:
                        if a.desired == "run":
                            self._start(a, now)
                        continue
                    self._follow(known, a, now)
                for key, rec in list(self._runs.items()):
                    if key not in named and rec.state == RUNNING and rec.stop_seen_at is None:
                        self._begin_stop(rec, now, rec.grace_s, None, "no longer assigned")
            for rec in list(self._runs.values()):
                if rec.state == RUNNING and rec.kill_at is not None and rec.kill_sent_at is None:
                    if now >= rec.kill_at:
                        self._kill(rec, now)
            self._forget()
            if self._burnin is not None:
                busy = any(r.state == RUNNING for r in self._runs.values())
                self._burnin.advance(desired.burn_in if desired else None, busy, now)
                if self._burnin.pending() is not None:
                    self._report_wake.set()
            busy_devices = {
                d
                for r in self._runs.values()
                if r.state == RUNNING
                for d in r.assignment.get("devices") or []
            }
            burning = self._burnin is not None and self._burnin.running()
        # Outside the lock: nvidia-smi takes seconds, and the reporter goes on meanwhile (the
        # applier keeps its own). Only this thread starts runs, so none starts under it.
        if self._mig is not None:
            layouts = desired.mig_layouts if desired is not None else []
            if self._mig.advance(layouts, busy_devices, burning):
                with self._lock:
                    self._reread_inventory()  # the new instances' UUIDs, for runs and the report
            if self._mig.pending():
                self._report_wake.set()

    def _capable(self, inventory: Inventory) -> Inventory:
        """The inventory with what this agent can do (`mig-layout` when it can apply them)."""
        caps: list[Any] = ["mig-layout"] if self._mig is not None and self._mig.able else []
        if self._users.isolating:
            caps.append("run-uids")
        caps.append("volumes")  # it mounts tenants' volumes (an older agent did not)
        if self._volumes.shared:
            caps.append("shared-volumes")
        caps += [c for runtime in self._runtimes.values() for c in runtime.capabilities()]
        return inventory.model_copy(update={"capabilities": caps})

    def _changed(self, rec: RunRecord) -> None:
        rec.version += 1
        rec.save()
        self._report_wake.set()

    def _refusal(self, a: Assignment, rec: RunRecord) -> str | None:
        """Why the run cannot start here, if it cannot (`rec.fault`: whose that is)."""
        if a.runtime not in self._runtimes:
            return (
                f"runtime {a.runtime} is not available on this node "
                f"(it has: {', '.join(self._runtime_names)})"
            )
        missing = [d for d in a.devices if d not in self._device_ids]
        if missing:
            return f"device(s) not on this node: {', '.join(missing)}"
        try:
            self._runtimes[a.runtime].check(a)
        except runtimes.StartError as exc:
            if isinstance(exc, runtimes.WorkloadStartError):
                rec.fault = "workload"
            return str(exc)
        return None

    def _secret_env(self, a: Assignment) -> tuple[dict[str, str], str | None] | None:
        """The run's secret env, fetched as it starts, and why it cannot start if the control
        plane refuses it (`run_refused`: the workload's own doing); None: not now (try again
        later)."""
        if not a.fetch_env:
            return {}, None
        key = run_key(a.workload_id, a.attempt, a.replica)
        if time.monotonic() < self._env_retry_at.get(key, 0.0):
            return None
        try:
            env = self.client.run_env(a.workload_id, a.attempt, a.replica).env
        except CredentialRefused:
            return None  # the sync loop stops the agent
        except ApiError as exc:
            if exc.code == "run_refused":
                self._env_retry_at.pop(key, None)
                return {}, exc.detail
            self._env_retry_at[key] = time.monotonic() + self.config.backoff_max / 4
            log.warning(kv("run_env_unavailable", run=key, error=exc))
            return None
        except TransientError as exc:
            self._env_retry_at[key] = time.monotonic() + self.config.backoff_max / 4
            log.warning(kv("run_env_unavailable", run=key, error=exc))
            return None
        self._env_retry_at.pop(key, None)
        return env, None

    def _start(self, a: Assignment, now: float) -> None:
        fetched = self._secret_env(a)
        if fetched is None:
            return
        secret, refused = fetched
        run_dir = self.state.run_dir(a.workload_id, a.attempt, a.replica)
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        rec = RunRecord(
            workload_id=a.workload_id,
            attempt=a.attempt,
            replica=a.replica,
            assignment=a.model_dump(mode="json"),
            grace_s=a.grace_s,
            checkpoints_sent=a.checkpoint_requests,
            run_dir=run_dir,
        )
        self._runs[rec.key] = rec
        problem = self._refusal(a, rec)
        if problem is None and refused:
            problem, rec.fault = refused, "workload"
        # The SSH port is the agent's to choose, whatever the assignment says.
        port = None
        if problem is None and a.ssh_keys and self._runtimes[a.runtime].serves_ssh:
            port = self._ssh_port()
            if port is None:
                first, last = self.config.ssh_ports
                problem = (
                    f"no free SSH port on this node: each of {first}-{last} (--ssh-ports) is "
                    "held by a run or in use on the host"
                )
        serve_port = None
        if problem is None and a.serve is not None:
            serve_port = self._serve_port()
            if serve_port is None:
                first, last = self.config.serve_ports
                problem = (
                    f"no free serving port on this node: each of {first}-{last} (--serve-ports) "
                    "is held by a run or in use on the host"
                )
        if problem is None:
            rec.exit_file.unlink(missing_ok=True)
            try:
                in_use = {r.uid for r in self._runs.values() if r.uid is not None}
                runtime = self._runtimes[a.runtime]
                place = self._users.take(run_dir.name, in_use, a.run_gid, runtime.own_uid)
                rec.uid = place.user.uid if place.user else None
                rec.workdir = str(place.workdir)
                if a.volumes:
                    mounted = self._volumes.host_dirs(a, place.user)
                    place = dataclasses.replace(place, volumes=tuple(mounted))
                rec.ssh_port, rec.serve_port = port, serve_port
                started = a.model_copy(
                    update={
                        "ssh_port": port,
                        "serve_port": serve_port,
                        "env": self._run_env(a, serve_port),
                    }
                )
                self._runtimes[a.runtime].start(rec, started, secret, place)
            except (runtimes.StartError, OSError) as exc:
                problem = str(exc)
                rec.ssh_port = rec.serve_port = None
                if isinstance(exc, runtimes.WorkloadStartError):
                    rec.fault = "workload"
            else:
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
        if problem is not None:
            rec.state = FAILED_TO_START
            rec.ended_at = now
            rec.message = problem[:2000]
            log.warning(kv("run_failed_to_start", run=rec.key, reason=problem))
            try:  # the customer reads why in the workload's logs, not only in its events
                with open(rec.output, "ab") as out:
                    out.write(f"rackplane-agent: the run could not start: {problem}\n".encode())
            except OSError:
                pass
        self._changed(rec)

    def _run_env(self, a: Assignment, serve_port: int | None = None) -> dict[str, str]:
        """The assignment's env with what this host adds: the interface a gang's hosts reach
        each other on, and the port a serving run listens on: the node's own for a process,
        the endpoint's inside a container (the run's own env, fetched as it starts, still
        wins)."""
        added: dict[str, str] = {}
        iface = self.config.data_interface
        if iface and "MASTER_ADDR" in a.env:
            added |= {"NCCL_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface}
        if a.serve is not None and serve_port is not None:
            added["PORT"] = str(serve_port if a.runtime == "process" else a.serve.port)
        return {**added, **a.env}

    def _serve_port(self) -> int | None:
        """A port of `--serve-ports` for a serving run starting now: one no live run holds,
        free on the host, in turn after the last one handed out."""
        held = {r.serve_port for r in self._runs.values() if r.state == RUNNING and r.serve_port}
        port = sshports.pick(self.config.serve_ports, held, self._serve_after)
        if port is not None:
            self._serve_after = port
        return port

    def check_serving(self) -> None:
        """GET the readiness path of each running serving run not ready yet (each at most
        every SERVE_PROBE_INTERVAL, all at once); one that answers 2xx is reported ready."""
        mono = time.monotonic()
        with self._lock:
            due = []
            for r in self._runs.values():
                serve = (r.assignment or {}).get("serve")
                if r.state != RUNNING or r.serve_port is None or r.serve_ready or not serve:
                    continue
                if mono < self._serve_next_probe.get(r.key, 0.0):
                    continue
                self._serve_next_probe[r.key] = mono + SERVE_PROBE_INTERVAL
                due.append((r.key, r.serve_port, serve["ready_path"]))
        if not due:
            return
        answered = serving.ready([(p, path) for _, p, path in due], timeout=SERVE_PROBE_TIMEOUT)
        with self._lock:
            for key, port, _ in due:
                rec = self._runs.get(key)
                if port not in answered or rec is None or rec.state != RUNNING:
                    continue
                if rec.serve_port != port or rec.serve_ready:
                    continue
                rec.serve_ready = True
                self._serve_next_probe.pop(key, None)
                after = self.clock() - rec.started_at if rec.started_at is not None else None
                log.info(
                    kv(
                        "serve_ready",
                        run=key,
                        port=port,
                        after_s=round(after, 2) if after is not None else None,
                    )
                )
                self._changed(rec)

    def _ssh_port(self) -> int | None:
        """A port of `--ssh-ports` for a run starting now (`sshports.pick`), or None: one no
        live run holds, no runtime's plumbing forwards (a stale DNAT rule of netavark's would
        catch its traffic), free on the host, in turn after the last one handed out (kept in
        the state directory, so an agent restarted goes on from there)."""
        held = {r.ssh_port for r in self._runs.values() if r.state == RUNNING and r.ssh_port}
        forwarded = {p for rt in self._runtimes.values() for p in rt.forwarded_ports()}
        skipped = sorted(
            p for p in forwarded - held if self.config.ssh_ports[0] <= p <= self.config.ssh_ports[1]
        )
        if skipped:
            log.info(kv("ssh_ports_forwarded", ports=",".join(map(str, skipped[:20]))))
        port = sshports.pick(self.config.ssh_ports, held | forwarded, self.state.read_ssh_port())
        if port is not None:
            self.state.write_ssh_port(port)
        return port

    def check_ssh(self) -> None:
        """Knock on the SSH port of each running run whose server has not answered yet (each
        at most every SSH_PROBE_INTERVAL, all at once, within SSH_PROBE_TIMEOUT); a run whose
        server greets is reported ready."""
        mono = time.monotonic()
        with self._lock:
            due = [
                (r.key, r.ssh_port)
                for r in self._runs.values()
                if r.state == RUNNING
                and r.ssh_port is not None
                and not r.ssh_ready
                and mono >= self._ssh_next_probe.get(r.key, 0.0)
            ]
            for key, _ in due:
                self._ssh_next_probe[key] = mono + SSH_PROBE_INTERVAL
        if not due:
            return
        answered = sshports.banners([port for _, port in due], timeout=SSH_PROBE_TIMEOUT)
        if not answered:
            return
        with self._lock:
            for key, port in due:
                rec = self._runs.get(key)
                if port not in answered or rec is None or rec.state != RUNNING:
                    continue
                if rec.ssh_port != port or rec.ssh_ready:
                    continue
                rec.ssh_ready = True
                self._ssh_next_probe.pop(key, None)
                after = self.clock() - rec.started_at if rec.started_at is not None else None
                log.info(
                    kv(
                        "ssh_ready",
                        run=key,
                        port=port,
                        after_s=round(after, 2) if after is not None else None,
                    )
                )
                self._changed(rec)

    def _follow(self, rec: RunRecord, a: Assignment, now: float) -> None:
        """An existing run and its (latest) assignment."""
        copy = a.model_dump(mode="json")
        if copy != rec.assignment:
            rec.assignment = copy
            rec.grace_s = a.grace_s
            rec.save()
        if rec.state != RUNNING:
            return
        if a.desired == "stop":
            if rec.stop_seen_at is None:
                deadline = a.stop_deadline.timestamp() if a.stop_deadline else None
                self._begin_stop(rec, now, a.grace_s, deadline, "asked to stop")
            return
        if a.checkpoint_requests > rec.checkpoints_sent and rec.stop_seen_at is None:
            if (
                rec.started_at is not None
                and now - rec.started_at < self.config.checkpoint_min_age_s
            ):
                return  # its handlers may not be installed yet: next pass
            sig = parse_signal(a.checkpoint_signal)
            if sig is None:
                log.warning(
                    kv("checkpoint_signal_unknown", run=rec.key, signal=a.checkpoint_signal)
                )
            else:
                self._driver(rec).signal(rec, sig)
                log.info(
                    kv(
                        "checkpoint_requested",
                        run=rec.key,
                        signal=sig.name,
                        request=a.checkpoint_requests,
                    )
                )
            rec.checkpoints_sent = a.checkpoint_requests
            rec.save()

    def _begin_stop(
        self, rec: RunRecord, now: float, grace: float, deadline: float | None, why: str
    ) -> None:
        rec.stop_seen_at = now
        rec.stopped = True
        rec.kill_at = now + grace if deadline is None else min(now + grace, deadline)
        if rec.term_sent_at is None:
            self._driver(rec).signal(rec, signal.SIGTERM)
            rec.term_sent_at = now
        log.info(
            kv(
                "run_stopping",
                run=rec.key,
                pid=rec.pid,
                reason=why,
                kill_in_s=round(rec.kill_at - now, 2),
            )
        )
        self._changed(rec)

    def _kill(self, rec: RunRecord, now: float) -> None:
        self._driver(rec).signal(rec, signal.SIGKILL)
        self._users.sweep(rec.uid)
        rec.kill_sent_at = now
        log.warning(
            kv(
                "run_killed",
                run=rec.key,
                pid=rec.pid,
                after_s=round(now - (rec.term_sent_at or now), 2),
            )
        )
        rec.save()

    # --- watching processes ----------------------------------------------------------------

    def _driver(self, rec: RunRecord) -> runtimes.Runtime:
        """The run's runtime (one this agent no longer offers is still watched, signalled and
        ended the way every runtime here is: a shim's group)."""
        return self._runtimes.get(rec.assignment.get("runtime", "process"), self._shim)

    def _ended(
        self,
        rec: RunRecord,
        now: float,
        while_down: bool = False,
        seen_alive: float | None = None,
    ) -> None:
        self._users.sweep(rec.uid)  # what the run left behind goes with it
        exit_record = self._driver(rec).exit(rec)
        returncode = rec.popen.returncode if rec.popen is not None else None
        rec.popen = None
        if exit_record is not None:
            rec.state = EXITED
            code = exit_record.get("exit_code")
            rec.exit_code = code if isinstance(code, int) and -255 <= code <= 255 else None
            sig = exit_record.get("signal")
            rec.signal = str(sig)[:16] if sig else None
            rec.ended_at = _parse_iso(exit_record.get("at")) or now
        elif rec.kill_sent_at is not None:
            rec.state, rec.signal, rec.stopped = EXITED, "SIGKILL", True
            rec.ended_at = now
        elif returncode is not None and returncode < 0:
            rec.state = EXITED
            rec.signal = signal_name(-returncode)
            rec.ended_at = now
            rec.message = "the run's shim was killed"
        elif returncode is not None:
            # Its shim ended as it does after its process, yet no exit record is there: this
            # agent failed to keep it (it could not be written or read), not the workload.
            rec.state, rec.fault = LOST, "agent"
            rec.ended_at = now
            rec.message = (
                f"the run's shim ended (code {returncode}) but its exit record could not be "
                "read: the agent's failure"
            )
        else:
            rec.state = LOST
            rec.ended_at = now
            rec.message = "the run's process is gone and left no exit record"
            if while_down and seen_alive is not None:
                # It ran at least until the earlier agent last saw it; nothing says longer.
                rec.ended_at = min(now, max(seen_alive, rec.started_at or seen_alive))
                at = datetime.fromtimestamp(rec.ended_at).astimezone()
                rec.message += f"; last seen running at {at:%Y-%m-%d %H:%M:%S %z}"
        log.info(
            kv(
                "run_ended",
                run=rec.key,
                state=rec.state,
                exit_code=rec.exit_code,
                signal=rec.signal,
                stopped=rec.stopped,
                while_agent_down=while_down or None,
            )
        )
        self._changed(rec)

    def _forget(self) -> None:
        """Runs that ended, whose end the control plane acknowledged, that no assignment names
        and whose output is shipped: their directory goes."""
        if self._assignments is None:
            return
        named = {
            run_key(a.workload_id, a.attempt, a.replica) for a in self._assignments.assignments
        }
        for key, rec in list(self._runs.items()):
            if rec.state == RUNNING or key in named or rec.acked_version < rec.version:
                continue
            if self._logs_enabled:
                try:
                    size = rec.output.stat().st_size
                except OSError:
                    size = 0
                if rec.log_offset < size:
                    continue
            self._driver(rec).destroy(rec)
            self._users.remove(rec.workdir)
            self._users.release(rec.uid)  # swept when it ended
            StateDir.remove_run(rec.run_dir)
            del self._runs[key]
            self._ssh_next_probe.pop(key, None)
            log.info(kv("run_forgotten", run=key))

    # --- reports ---------------------------------------------------------------------------

    def _run_report(self, rec: RunRecord) -> RunReport:
        if rec.state == RUNNING:
            at = rec.started_at
        else:
            at = rec.ended_at
        at_dt = datetime.fromtimestamp(at if at is not None else self.clock()).astimezone()
        tail = logs_mod.tail(rec.output) if rec.state in (EXITED, LOST) else []
        return RunReport(
            workload_id=rec.workload_id,
            attempt=rec.attempt,
            replica=rec.replica,
            state=cast(RunState, rec.state),
            at=at_dt,
            pid=rec.pid,
            exit_code=rec.exit_code if rec.state == EXITED else None,
            signal=rec.signal if rec.state == EXITED else None,
            stopped=rec.stopped and rec.state != FAILED_TO_START,
            message=rec.message,
            fault=_fault(rec),
            # The endpoint while it runs (the port is free again once it has ended).
            ssh_port=rec.ssh_port if rec.state == RUNNING else None,
            ssh_ready=rec.ssh_ready and rec.state == RUNNING,
            serve_port=rec.serve_port if rec.state == RUNNING else None,
            serve_ready=rec.serve_ready and rec.state == RUNNING,
            tail=tail,
        )

    def report(self, force: bool = False) -> bool:
        """POST /status when something changed, or a heartbeat is due; True when sent.
        Raises CredentialRefused."""
        mono = time.monotonic()
        with self._lock:
            burn = self._burnin.pending() if self._burnin is not None else None
            mig = self._mig.pending() if self._mig is not None else []
            changed = (
                burn is not None
                or bool(mig)
                or any(r.version > r.acked_version for r in self._runs.values())
            )
            heartbeat_due = (
                self._last_report_ok is None
                or mono - self._last_report_ok >= 0.8 * self._heartbeat_s
            )
            if not (force or changed or heartbeat_due) or mono < self._next_report_at:
                return False
            sent = [(r.key, r.version) for r in self._runs.values()]
            reports = [self._run_report(r) for r in self._runs.values()]
            fresh = None
            if burn is not None and self._burnin is not None and self._burnin.wants_inventory():
                fresh = self._reread_inventory()
            if fresh is None and mig:
                fresh = self.inventory  # read again after the layout was applied
        try:
            ack = self.client.status(
                StatusReport(
                    runs=reports,
                    burn_in=burn[0] if burn is not None else None,
                    inventory=fresh,
                    mig_layouts=[m[0] for m in mig],
                )
            )
        except (TransientError, ApiError) as exc:
            if isinstance(exc, CredentialRefused):
                raise
            delay = self._report_backoff.next(exc)
            self._next_report_at = time.monotonic() + delay
            log.warning(kv("status_failed", error=exc, retry_in_s=round(delay, 2)))
            return False
        with self._lock:
            for key, version in sent:
                rec = self._runs.get(key)
                if rec is not None:
                    rec.acked_version = max(rec.acked_version, version)
            if burn is not None and self._burnin is not None:
                self._burnin.acked(burn[1])
            if mig and self._mig is not None:
                self._mig.acked([(gpu, lid, version) for _, gpu, lid, version in mig])
            self._last_report_ok = time.monotonic()
            self._next_report_at = 0.0
            self._report_backoff.reset()
            self._forget()
        if reports:
            log.debug(kv("status_sent", runs=len(reports), accepted=ack.accepted, stale=ack.stale))
        return True

    def ship_logs(self) -> bool:
        """POST /logs with new output of every run; True when more is waiting."""
        if not self._logs_enabled or time.monotonic() < self._next_logs_at:
            return False
        with self._lock:
            items = [
                (r.key, r.workload_id, r.attempt, r.replica, r.output, r.log_offset, r.state)
                for r in self._runs.values()
            ]
        chunks: list[LogChunk] = []
        ends: dict[str, int] = {}
        budget = self._logs_budget
        more = False
        now_dt = datetime.fromtimestamp(self.clock()).astimezone()
        for key, wid, attempt, replica, path, offset, state in items:
            if budget <= 0 or len(chunks) >= 400:
                more = True
                break
            pieces = logs_mod.read_chunks(path, offset, final=state != RUNNING, max_bytes=budget)
            for at, data in pieces:
                chunks.append(
                    LogChunk(
                        workload_id=wid,
                        attempt=attempt,
                        replica=replica,
                        offset=at,
                        data=logs_mod.decode(data),
                        at=now_dt,
                    )
                )
                ends[key] = at + len(data)
                budget -= len(data)
        if not chunks:
            return False
        try:
            self.client.logs(LogBatch(chunks=chunks))
        except RouteMissing:
            log.warning(
                kv(
                    "logs_route_missing",
                    detail="the control plane has no POST /v1/agent/logs; "
                    "output stays in the run directories",
                )
            )
            self._logs_enabled = False
            return False
        except CredentialRefused:
            raise
        except TransientError as exc:
            delay = self._logs_backoff.next(exc)
            self._next_logs_at = time.monotonic() + delay
            log.warning(kv("logs_failed", error=exc, retry_in_s=round(delay, 2)))
            return False
        except ApiError as exc:
            # Offsets advance only on a 2xx: the same output is offered again, later (a 413:
            # in smaller batches).
            if exc.status == 413 and self._logs_budget > logs_mod.CHUNK_BYTES:
                self._logs_budget = max(logs_mod.CHUNK_BYTES, self._logs_budget // 2)
                delay = 0.0
            else:
                delay = self.config.backoff_max
            self._next_logs_at = time.monotonic() + delay
            log.error(kv("logs_refused", error=exc, chunks=len(chunks), retry_in_s=delay))
            return False
        self._logs_backoff.reset()
        with self._lock:
            for key, end in ends.items():
                rec = self._runs.get(key)
                if rec is not None and end > rec.log_offset:
                    rec.log_offset = end
                    rec.save()
        return more or budget <= 0

    # --- threads ---------------------------------------------------------------------------

    def _set_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self._stop.set()
        self._wake.set()
        self._report_wake.set()

    def _check_node(self, retry: dict[str, Any]) -> None:
        try:
            node = self.client.node(**retry)
        except RouteMissing:
            log.warning(kv("node_route_missing", detail="no GET /v1/agent/node; going on"))
            return
        known = self.state.read_node()
        if node.get("node_name") and node.get("node_name") != known.get("node_name"):
            self.state.write_node(
                {**known, "node_id": node.get("node_id"), "node_name": node.get("node_name")}
            )
        log.info(
            kv("node", name=node.get("node_name"), rack=node.get("rack"), region=node.get("region"))
        )

    def _reread_inventory(self) -> Inventory | None:
        """The host's inventory read again (an upgrade's steps changed its software); None
        when it cannot be read (the report goes without it, and the control plane judges the
        versions it last had). With NVML, versions loaded in this process may be the old
        ones until the host reboots (a driver upgrade does), which restarts the agent."""
        assert self.inventory is not None
        try:
            fresh = inventory_mod.collect(
                inventory_file=self.config.inventory_file,
                address=self.config.address or self.inventory.address,
                runtimes=self._runtime_names,
                nvml=self._nvml,
                hostname=self.inventory.hostname,
            )
        except inventory_mod.InventoryError as exc:
            log.error(kv("inventory_reread_failed", error=exc))
            return None
        fresh = self._capable(fresh)
        if fresh != self.inventory:
            log.info(
                kv(
                    "inventory_changed",
                    driver=fresh.driver_version,
                    cuda=fresh.cuda_version,
                    nccl=fresh.nccl_version,
                    firmware=fresh.firmware_version,
                )
            )
        self.inventory = fresh
        self._device_ids = inventory_mod.device_ids(fresh)
        for runtime in self._runtimes.values():
            runtime.use_inventory(fresh)
        return fresh

    def _send_inventory(self, retry: dict[str, Any]) -> None:
        assert self.inventory is not None
        try:
            verdict = self.client.put_inventory(self.inventory, **retry)
        except RouteMissing:
            log.warning(
                kv("inventory_route_missing", detail="no PUT /v1/agent/inventory; going on")
            )
        else:
            (log.info if verdict.matches else log.warning)(
                kv(
                    "inventory_verdict",
                    node=verdict.node,
                    matches=verdict.matches,
                    node_state=verdict.node_state,
                    differences="; ".join(verdict.differences) or None,
                )
            )
        self._inventory_sent.set()
        self._report_wake.set()

    def _sync_loop(self) -> None:
        """GET /node, PUT /inventory, then the long poll for assignments, for ever."""
        backoff = Backoff(self.config.backoff_initial, self.config.backoff_max)
        retry: dict[str, Any] = {"attempts": None, "stop_event": self._stop}
        steps = ["node", "inventory"]
        index = 0
        while not self._stop.is_set():
            step = steps[0] if steps else "assignments"
            try:
                if step == "node":
                    self._check_node(retry)
                    steps.pop(0)
                    continue
                if step == "inventory":
                    self._send_inventory(retry)
                    steps.pop(0)
                    continue
                began = time.monotonic()
                assignments = self.client.assignments(index, self.config.poll_wait, **retry)
                if assignments.index != index or self._assignments is None:
                    log.info(
                        kv(
                            "assignments",
                            index=assignments.index,
                            runs=len(assignments.assignments),
                        )
                    )
                quick = time.monotonic() - began < 0.05 and assignments.index == index
                index = assignments.index
                self.set_assignments(assignments)
                backoff.reset()
                if quick:  # a server answering at once with nothing new: do not spin
                    self._stop.wait(min(1.0, self.config.poll_wait))
            except CredentialRefused as exc:
                self._set_fatal(exc)
                return
            except Exception as exc:  # ApiError (retried by going round), or a bug
                if self._stop.is_set():
                    return  # a TransientError when stopping, or the client closed under it
                delay = backoff.next()
                if isinstance(exc, ApiError):
                    log.error(kv("sync_error", step=step, error=exc, retry_in_s=round(delay, 2)))
                else:
                    log.exception(kv("sync_crashed", step=step, error=exc))
                self._stop.wait(delay)

    def _report_loop(self) -> None:
        last_logs = 0.0
        while not self._stop.is_set():
            try:
                if self._inventory_sent.is_set():
                    self.check_ssh()
                    self.check_serving()
                    self.report()
                    mono = time.monotonic()
                    if mono - last_logs >= self.config.log_interval:
                        last_logs = mono
                        if self.ship_logs():
                            last_logs = 0.0  # a backlog: next round at once
            except CredentialRefused as exc:
                self._set_fatal(exc)
                return
            except Exception as exc:
                log.exception(kv("reporter_crashed", error=exc))
            self._report_wake.wait(self.config.reconcile_interval)
            self._report_wake.clear()

    def _telemetry_source(self) -> Any | None:
        from rackplane_agent import telemetry

        if self.config.dcgm_exporter:
            return telemetry.DcgmScraper(self.config.dcgm_exporter)
        if self._nvml is not None and self.inventory is not None:
            return telemetry.NvmlSampler(self._nvml, self.inventory.hostname)
        return None

    def _telemetry_loop(self) -> None:
        try:
            source = self._telemetry_source()
        except Exception as exc:
            log.warning(kv("telemetry_unavailable", error=exc))
            return
        if source is None:
            return
        self._inventory_sent.wait()
        while not self._stop.is_set():
            try:
                text = source.collect()
                if text:
                    self.client.telemetry(text)
            except RouteMissing:
                log.warning(
                    kv(
                        "telemetry_route_missing",
                        detail="the control plane has no POST /v1/agent/telemetry",
                    )
                )
                break
            except CredentialRefused as exc:
                self._set_fatal(exc)
                break
            except Exception as exc:  # the exporter or the server: next time
                log.warning(kv("telemetry_failed", error=exc))
            self._stop.wait(self.config.telemetry_interval)
        source.close()

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=f"rackplane-agent-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    # --- the whole program -----------------------------------------------------------------

    def run(self) -> int:
        """Run until shutdown() (0) or a refused credential (3); 2 when it cannot start."""
        try:
            self.prepare()
            self.connect()
        except StartupError as exc:
            stopped = self._stop.is_set()
            if not stopped:
                log.error(kv("cannot_start", reason=exc))
            self.close()
            return EXIT_OK if stopped else EXIT_USAGE
        if self._stop.is_set():
            self.close()
            return EXIT_OK
        self._spawn("sync", self._sync_loop)
        self._spawn("reporter", self._report_loop)
        self._spawn("telemetry", self._telemetry_loop)
        code = EXIT_OK
        try:
            while not self._stop.is_set():
                self.reconcile()
                self._wake.wait(self.config.reconcile_interval)
                self._wake.clear()
        except Exception as exc:
            log.exception(kv("agent_crashed", error=exc))
            code = EXIT_ERROR
        if isinstance(self._fatal, CredentialRefused):
            with self._lock:
                running = [r.key for r in self._runs.values() if r.state == RUNNING]
            log.error(
                kv(
                    "credential_revoked",
                    detail=f"the control plane refused this node's credential "
                    f"({self._fatal.code}); runs are left running; remove "
                    f"{self.state.credential_file} and start again with a new --token to rejoin",
                    running=",".join(running) or None,
                )
            )
            code = EXIT_REVOKED
        self.close()
        return code

    def shutdown(self) -> None:
        """Stop the agent (not its runs)."""
        self._stop.set()
        self._wake.set()
        self._report_wake.set()
        self._inventory_sent.set()  # releases the telemetry thread

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        self.state.unlock()
        self.client.close()


def _fault(rec: RunRecord) -> Literal["workload", "agent"] | None:
    """Whose fault a run's end is, where it is not the host's: the workload's own start
    failure, or this agent's failure to record a lost run's exit."""
    if rec.state == FAILED_TO_START and rec.fault == "workload":
        return "workload"
    if rec.state == LOST and rec.fault == "agent":
        return "agent"
    return None
