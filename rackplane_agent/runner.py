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
(`readiness`: each unready run at most every SSH_PROBE_INTERVAL, all at once) until an SSH
server greets, and reports it ready.

The `Agent` here holds the state the threads share (the runs, under one lock) and decides when
each step happens; the steps live beside it, each taking what it needs as arguments: `startup`
(the state directory, the credential, the first inventory), `nodeinfo` (the inventory reported),
`starting` (a run's start), `signalling` (stops, kills, checkpoints), `exits` (a run's end),
`readiness` (SSH and serving probes), `reports` (POST /status and /logs) and `loops` (the sync
and telemetry threads).

Nothing the control plane says or fails to say kills a run by itself: a refused credential, an
unreachable server, the agent's own restart all leave the runs running. Every run is watched
by polling (its shim's pid and create time, and its exit file), so a run started by an earlier
agent process is adopted like one of this one's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rackplane_agent import (
    exits,
    loops,
    nodeinfo,
    readiness,
    reports,
    runtimes,
    signalling,
    starting,
    startup,
)
from rackplane_agent import inventory as inventory_mod
from rackplane_agent.burnin import BurnInRunner
from rackplane_agent.cgroups import Cgroups
from rackplane_agent.client import (
    ApiError,
    Backoff,
    Client,
    CredentialRefused,
    RouteMissing,
    TransientError,
)
from rackplane_agent.config import EXIT_ERROR, EXIT_OK, EXIT_REVOKED, EXIT_USAGE, AgentConfig
from rackplane_agent.logfmt import kv
from rackplane_agent.mig import MigApplier
from rackplane_agent.runusers import RunUsers, WorkDirError
from rackplane_agent.startup import StartupError
from rackplane_agent.state import RUNNING, RunRecord, StateDir, run_key
from rackplane_agent.volumes import Volumes
from rackplane_wire import Assignment, Assignments, Inventory, LogBatch, StatusReport

log = logging.getLogger("rackplane_agent")


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
        self._logs_budget = reports.LOG_BATCH_BYTES
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
        startup.lock_state(self.state)
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
            self.inventory = startup.first_inventory(self.config, self._runtime_names, self._nvml)
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
        startup.log_inventory(self.inventory)
        self._scan()
        self._prepared = True

    def connect(self) -> None:
        """The node credential: the stored one, else a join with the token. Raises
        StartupError (no token, a refused token)."""
        startup.connect(self.client, self.state, self.config, self._stop)

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
            if alive:
                self._alive_marked = exits.mark_alive(self.state, now, self._alive_marked)
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
                        signalling.kill(rec, self._driver(rec), self._users, now)
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
        return nodeinfo.with_capabilities(
            inventory,
            mig_able=self._mig is not None and self._mig.able,
            run_uids=self._users.isolating,
            shared_volumes=self._volumes.shared,
            offered=self._runtimes.values(),
        )

    def _changed(self, rec: RunRecord) -> None:
        rec.version += 1
        rec.save()
        self._report_wake.set()

    def _start(self, a: Assignment, now: float) -> None:
        """Start a run newly assigned, or end it as `failed_to_start` with why."""
        fetched = starting.secret_env(
            self.client, a, self._env_retry_at, self.config.backoff_max / 4
        )
        if fetched is None:
            return
        secret, refused = fetched
        rec = starting.new_record(a, self.state)
        self._runs[rec.key] = rec
        problem = starting.refusal(a, rec, self._runtimes, self._runtime_names, self._device_ids)
        if problem is None and refused:
            problem, rec.fault = refused, "workload"
        ssh_port = serve_port = None
        if problem is None:
            ssh_port, serve_port, problem = starting.claim_ports(
                a, self._runs.values(), self._runtimes, self.state, self.config, self._serve_after
            )
            if serve_port is not None:
                self._serve_after = serve_port  # the next serving run's port comes after it
        if problem is None:
            problem = starting.launch(
                rec,
                a,
                secret,
                runs=self._runs.values(),
                runtime=self._runtimes[a.runtime],
                users=self._users,
                volumes=self._volumes,
                ssh_port=ssh_port,
                serve_port=serve_port,
                data_interface=self.config.data_interface,
                now=now,
            )
        if problem is not None:
            starting.record_failed_start(rec, now, problem)
        self._changed(rec)

    def check_serving(self) -> None:
        """GET the readiness path of each running serving run not ready yet (each at most
        every SERVE_PROBE_INTERVAL, all at once); one that answers 2xx is reported ready."""
        mono = time.monotonic()
        with self._lock:
            due = readiness.serve_due(self._runs.values(), self._serve_next_probe, mono)
        if not due:
            return
        answered = readiness.knock_serving(due)
        with self._lock:
            readiness.mark_serve_ready(
                self._runs, due, answered, self._serve_next_probe, self.clock, self._changed
            )

    def check_ssh(self) -> None:
        """Knock on the SSH port of each running run whose server has not answered yet (each
        at most every SSH_PROBE_INTERVAL, all at once, within SSH_PROBE_TIMEOUT); a run whose
        server greets is reported ready."""
        mono = time.monotonic()
        with self._lock:
            due = readiness.ssh_due(self._runs.values(), self._ssh_next_probe, mono)
        if not due:
            return
        answered = readiness.knock_ssh(due)
        if not answered:
            return
        with self._lock:
            readiness.mark_ssh_ready(
                self._runs, due, answered, self._ssh_next_probe, self.clock, self._changed
            )

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
            signalling.checkpoint(rec, a, self._driver(rec), now, self.config.checkpoint_min_age_s)

    def _begin_stop(
        self, rec: RunRecord, now: float, grace: float, deadline: float | None, why: str
    ) -> None:
        """SIGTERM the run now, SIGKILL it once its grace (or `deadline`) is over."""
        signalling.begin_stop(rec, self._driver(rec), now, grace, deadline, why)
        self._changed(rec)

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
        """A run whose process is gone: how it ended, recorded and reported."""
        self._users.sweep(rec.uid)  # what the run left behind goes with it
        exit_record = self._driver(rec).exit(rec)
        returncode = rec.popen.returncode if rec.popen is not None else None
        rec.popen = None
        exits.record_end(rec, exit_record, returncode, now, while_down, seen_alive)
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
            if key in named or not exits.forgettable(rec, self._logs_enabled):
                continue
            self._driver(rec).destroy(rec)
            self._users.remove(rec.workdir)
            self._users.release(rec.uid)  # swept when it ended
            StateDir.remove_run(rec.run_dir)
            del self._runs[key]
            self._ssh_next_probe.pop(key, None)
            log.info(kv("run_forgotten", run=key))

    # --- reports ---------------------------------------------------------------------------

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
            run_reports = [reports.run_report(r, self.clock) for r in self._runs.values()]
            fresh = None
            if burn is not None and self._burnin is not None and self._burnin.wants_inventory():
                fresh = self._reread_inventory()
            if fresh is None and mig:
                fresh = self.inventory  # read again after the layout was applied
        try:
            ack = self.client.status(
                StatusReport(
                    runs=run_reports,
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
        if run_reports:
            log.debug(
                kv("status_sent", runs=len(run_reports), accepted=ack.accepted, stale=ack.stale)
            )
        return True

    def ship_logs(self) -> bool:
        """POST /logs with new output of every run; True when more is waiting."""
        if not self._logs_enabled or time.monotonic() < self._next_logs_at:
            return False
        with self._lock:
            sources = reports.log_sources(self._runs.values())
        now_dt = datetime.fromtimestamp(self.clock()).astimezone()
        batch = reports.output_batch(sources, self._logs_budget, now_dt)
        if not batch.chunks:
            return False
        try:
            self.client.logs(LogBatch(chunks=batch.chunks))
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
        except (TransientError, ApiError) as exc:
            delay, self._logs_budget = reports.logs_retry(
                exc,
                self._logs_backoff,
                self._logs_budget,
                refused_delay=self.config.backoff_max,
                chunks=len(batch.chunks),
            )
            self._next_logs_at = time.monotonic() + delay
            return False
        self._logs_backoff.reset()
        with self._lock:
            for key, end in batch.ends.items():
                rec = self._runs.get(key)
                if rec is not None and end > rec.log_offset:
                    rec.log_offset = end
                    rec.save()
        return batch.more or batch.budget_left <= 0

    # --- threads ---------------------------------------------------------------------------

    def _set_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self._stop.set()
        self._wake.set()
        self._report_wake.set()

    def _reread_inventory(self) -> Inventory | None:
        """The host's inventory read again (an upgrade's steps changed its software); None
        when it cannot be read (the report goes without it, and the control plane judges the
        versions it last had). With NVML, versions loaded in this process may be the old
        ones until the host reboots (a driver upgrade does), which restarts the agent."""
        assert self.inventory is not None
        fresh = nodeinfo.collect_again(self.config, self.inventory, self._runtime_names, self._nvml)
        if fresh is None:
            return None
        fresh = self._capable(fresh)
        nodeinfo.log_change(self.inventory, fresh)
        self.inventory = fresh
        self._device_ids = inventory_mod.device_ids(fresh)
        for runtime in self._runtimes.values():
            runtime.use_inventory(fresh)
        return fresh

    def _send_inventory(self, retry: dict[str, Any]) -> None:
        """PUT /inventory; the reporter and telemetry wait for it."""
        assert self.inventory is not None
        loops.put_inventory(self.client, self.inventory, retry)
        self._inventory_sent.set()
        self._report_wake.set()

    def _sync_loop(self) -> None:
        """GET /node, PUT /inventory, then the long poll for assignments, for ever."""
        loops.sync_loop(
            self.client,
            self.config,
            self.state,
            self._stop,
            send_inventory=self._send_inventory,
            known=lambda: self._assignments,
            take=self.set_assignments,
            fatal=self._set_fatal,
        )

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

    def _telemetry_loop(self) -> None:
        """The GPUs' telemetry, forwarded once the inventory is sent."""
        loops.telemetry_loop(
            self.client,
            self.config,
            self._nvml,
            self.inventory,
            stop=self._stop,
            inventory_sent=self._inventory_sent,
            fatal=self._set_fatal,
        )

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
