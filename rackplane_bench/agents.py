"""`rackplane bench agents`: N simulated node agents against one API process and a worker.

A scratch PostgreSQL database and Redis key prefix (as the other benches), a fleet of N HGX
H100-80GB nodes of 8 GPUs (racks of 32), a tenant and its key, and a single-use join token per
node, all made in one transaction by the services (`apply_document`, `create_join_token`). Then
one uvicorn API process and one Celery worker (beat included), and everything after goes over
HTTP from one asyncio event loop in this process (aiohttp: its pool costs O(1) per request with
a thousand long polls waiting, httpx's does not):

- each agent trades its join token (`POST /v1/agent/join`) for its credential and sends its
  inventory (`PUT /v1/agent/inventory`: the fleet's GPU indices and model, UUIDs
  `GPU-<node>-<i>`), at most `JOIN_CONCURRENCY` agents at a time;
- then long-polls `GET /v1/agent/assignments?index=N&wait=30s` for ever. Its second poll waits a
  random 1-30 s, so the fleet's polls do not time out together every 30 s (real agents start at
  different times);
- sends an empty `POST /v1/agent/status` every `heartbeat_s` (from the Assignments answer), the
  first at a random offset. (The real agent heartbeats at 0.8 x heartbeat_s and repeats the state
  of every run it holds in each report; the empty report is the cheaper, lower bound);
- when an assignment with `desired: run` appears, reports it `running` at once (no simulated
  start time; `at` = when the answer arrived) and `exited` with code 0 after the command's
  `sleep` length (10-30 s); `desired: stop` is reported as a stopped exit at once. A report that
  fails is sent again after a back-off (Retry-After on 503), as the real agent does.

Work is submitted open-loop at `rate` per second through `POST /v1/workloads` from the first
second of the warm-up to the end of the measured window: 3 of 5 are 1-GPU instances, 1 a one-node
8-GPU job, 1 a gang of two 8-GPU replicas; each runs `sleep L`, L = 10-30 s.

Measured over the `duration` window after the warm-up:
- assign_to_start: per run (replica), the moment the agent SENT its first `running` report minus
  the placement commit time of the workload's attempt (its `placing` transition event's `at`,
  which the placement cycle stamps at the cycle's start, a few ms before its commit: so this is
  a slight over-estimate). The agent sends the report as soon as the long poll's answer is
  parsed, so the receipt time is the same within the load generator's own loop lag
  (`received_to_sent_p99_s`). Runs whose placement falls in the window are measured; one placed
  but never reported within the drain after the window counts with the time it waited until the
  end (a lower bound), and is counted in `runs_unstarted`;
- the path in parts: placing -> provisioning (the worker's `workloads.provision`, from the
  events), provisioning -> received by the agent (the index bump, the Redis wake-up, the long
  poll's read), and sent -> acknowledged (the status report's round trip);
- API CPU (user + system of the uvicorn process), its share of the wall clock and per
  agent-minute; the worker's, PostgreSQL's (its server processes alive over the whole window,
  on the whole machine), this load generator's, and the machine's busy cores (whatever else
  runs on it is `other_cpu_share`) beside it;
- database rows inserted, updated or deleted (pg_stat_user_tables of the scratch database, read
  at both ends while the load runs, so both readings lag the same way; PostgreSQL flushes an
  idle backend's counts after up to 10 s, hence the 15 s warm-up after the joins), per
  agent-minute, and the tables that take most; connections PostgreSQL accepted for the database
  and its commits per second;
- every answer by status code (5xx must be 0), long polls answered, of them woken by a change,
  status reports, heartbeats;
- the bring-up burst (`bring_up_*`): from the first join until every agent's burn-in report
  (the first long poll's answer carries the burn-in; the simulated host has no DCGM or
  nccl-tests, so every step is skipped and reported done at once) was taken: its seconds, its
  answers by route and status, its latencies. It overlaps the warm-up, and the window when it
  outlasts it; a fleet's first hour is exactly that.

`--api-max-in-flight` sets the API's RACKPLANE_API_MAX_IN_FLIGHT; `--api-app` serves another
ASGI app (a wrapped `app.main:app` on PYTHONPATH: a server change measured before it is made).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rackplane_bench.deploy import (
    ROOT,
    ScratchDeployment,
    api_command,
    cpu_seconds,
    free_port,
    postgres_pids,
)

NODE_GPUS = 8
RACK_NODES = 32
MODEL = "H100-80GB"
POLL_WAIT_S = 30
JOIN_CONCURRENCY = 16
DEFAULT_RATE = 4.0
# Long enough for PostgreSQL's table statistics of the join phase (2 x agents requests) to be
# flushed before the window's first reading: a backend left idle flushes after 10 s.
WARMUP_S = 15.0
# After the window: how long runs placed in it may take to be reported (at most; half the window
# when that is shorter, at least 5 s). One still unreported then counts with what it waited.
DRAIN_S = 20.0
# `--quick`: the window of the form every change on the path can afford (bring-up included).
QUICK_DURATION_S = 20.0


def default_rate(agents: int) -> float:
    """A few submissions a second; fewer for a small fleet, so it stays partly free (each
    submission holds ~5.4 GPUs for ~20 s on average)."""
    return min(DEFAULT_RATE, max(0.2, agents / 25))


# The fleet's pool, one the deployment trusts with `process` runs (RACKPLANE_PROCESS_POOLS):
# the submissions are processes (what the simulated agents "run"), placed only in such pools.
POOL = "bench"


def fleet_document(nodes: int) -> str:
    racks = []
    for r in range(-(-nodes // RACK_NODES)):
        count = min(RACK_NODES, nodes - r * RACK_NODES)
        racks.append(
            f"      - name: ar{r:03d}\n        kind: hgx\n        gpu_model: {MODEL}\n"
            f"        pool: {POOL}\n"
            f"        node_template: {{count: {count}, name_prefix: ar{r:03d}-n}}\n"
        )
    return "regions:\n  - name: r1\n    racks:\n" + "".join(racks)


_SEED = """
import json, sys
import app.models
from sqlalchemy import select
from app.core.db import session_scope
from app.fleet import document
from app.fleet.service import apply_document
from app.tenants.service import create_tenant
from app.keys.service import create_key
from app.agents.service import create_join_token
from app.models.fleet import Gpu, Node
with session_scope() as s:
    apply_document(s, document.load(sys.stdin.read()))
    t = create_tenant(s, name='Agents', slug='agents', contact_email='a@example.com',
                      status='active', isolation_policy=None)
    key = create_key(s, tenant_id=t.id, name='bench', scopes=['read', 'write']).key
    s.flush()
    gpus = {}
    for name, index, model in s.execute(
        select(Node.name, Gpu.index, Gpu.model).join(Gpu, Gpu.node_id == Node.id)
    ):
        gpus.setdefault(name, []).append([index, model])
    nodes = []
    for node in s.scalars(select(Node).order_by(Node.name)):
        tok = create_join_token(s, node, 3600).token
        nodes.append([node.name, tok, sorted(gpus.get(node.name, []))])
    print(json.dumps({'key': key, 'nodes': nodes}))
"""


def seed(env: ScratchDeployment, nodes: int) -> tuple[str, list[tuple[str, str, list]]]:
    """The fleet, a tenant's key, and a join token per node (one transaction, in a child
    process on the scratch database, as the other benches seed)."""
    out = subprocess.run(
        [sys.executable, "-c", _SEED],
        cwd=ROOT,
        env=env.env,
        input=fleet_document(nodes),
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["key"], [tuple(n) for n in data["nodes"]]


# --- the simulated agents ------------------------------------------------------------------------


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _run_length(command: list[str]) -> float:
    """`sleep L` runs L seconds; anything else 20."""
    try:
        return float(command[1]) if command and command[0] == "sleep" else 20.0
    except (IndexError, ValueError):
        return 20.0


@dataclass
class Run:
    """One replica's run as its agent saw it (wall-clock seconds)."""

    workload_id: str
    attempt: int
    replica: int
    node: str
    received: float
    length: float
    sent: float | None = None  # the first `running` report left
    acked: float | None = None  # a `running` report was accepted (2xx)
    ended: bool = False
    exit_task: asyncio.Task | None = None


@dataclass
class Stats:
    codes: Counter = field(default_factory=Counter)  # (route, status) -> answers
    codes_all: Counter = field(default_factory=Counter)  # the same, join and drain included
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    long_polls: int = 0
    long_polls_woken: int = 0  # answered with a new index (a change, or the first answer)
    status_reports: int = 0  # POST /status answered 2xx (heartbeats included)
    heartbeats: int = 0
    run_reports: int = 0  # runs carried by accepted reports
    stale: int = 0
    measuring: bool = False  # counters above count only inside the window
    # The bring-up: from the first join until every agent's burn-in report was taken.
    bringing_up: bool = False
    codes_bring_up: Counter = field(default_factory=Counter)
    latency_bring_up: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def count(self, route: str, status: str, seconds: float) -> None:
        self.codes_all[(route, status)] += 1
        if self.measuring:
            self.codes[(route, status)] += 1
            self.latency[route].append(seconds)
        if self.bringing_up:
            self.codes_bring_up[(route, status)] += 1
            self.latency_bring_up[route].append(seconds)


class Sim:
    def __init__(self, url: str, agents: list[tuple[str, str, list]]):
        import aiohttp

        self.aiohttp = aiohttp
        self.url = url
        self.stats = Stats()
        self.runs: dict[tuple[str, int, int], Run] = {}
        self.stopping = False
        self.rng = random.Random(1000 + len(agents))
        self.agents = [Agent(self, n, t, g) for n, t, g in agents]
        self.tasks: list[asyncio.Task] = []
        self.session: Any = None
        self.joined = 0
        self.burned_in = 0  # agents whose bring-up burn-in report was taken
        self.all_burned_in = asyncio.Event()

    async def open(self) -> None:
        aiohttp = self.aiohttp
        self.session = aiohttp.ClientSession(
            base_url=self.url,
            # No bound: one connection per waiting long poll, plus the reports in flight.
            # Idle ones close before uvicorn's 5 s keep-alive would close them under a request.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        route: str,
        *,
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        body: Any = None,
        timeout: float = 60.0,
    ) -> tuple[int, Any, float | None]:
        """(status, parsed JSON or None, Retry-After); status 0 when no answer came."""
        aiohttp = self.aiohttp
        t = time.perf_counter()
        for attempt in range(2):
            try:
                async with self.session.request(
                    method,
                    path,
                    headers=headers,
                    params=params,
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as r:
                    raw = await r.read()
                    status = r.status
                    retry = r.headers.get("Retry-After")
                self.stats.count(route, str(status), time.perf_counter() - t)
                try:
                    data = json.loads(raw) if raw else None
                except ValueError:
                    data = None
                return status, data, float(retry) if retry and retry.isdigit() else None
            except aiohttp.ServerDisconnectedError:
                if attempt == 0:  # a kept-alive connection the server had just closed
                    continue
                self.stats.count(route, "disconnected", time.perf_counter() - t)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.stats.count(route, type(exc).__name__, time.perf_counter() - t)
            return 0, None, None
        return 0, None, None

    async def backoff(self, status: int, retry_after: float | None, tries: int) -> None:
        base = retry_after if retry_after is not None else min(10.0, 0.5 * 2 ** min(tries, 5))
        await asyncio.sleep(base + self.rng.random() * 0.5)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task

    async def join_all(self, concurrency: int = JOIN_CONCURRENCY) -> None:
        queue = list(reversed(self.agents))

        async def worker() -> None:
            while queue:
                agent = queue.pop()
                await agent.join()
                self.joined += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    def start(self) -> None:
        for a in self.agents:
            a.poll_task = self.spawn(a.poll_loop())
            self.spawn(a.heartbeat_loop())

    async def stop(self) -> None:
        self.stopping = True
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Agent:
    def __init__(self, sim: Sim, name: str, token: str, gpus: list):
        self.sim = sim
        self.name = name
        self.token = token
        self.gpus = gpus
        self.headers: dict[str, str] = {}
        self.index = 0
        self.heartbeat_s = 30.0
        self.burned: str | None = None  # the burn-in last reported
        self.runs: dict[tuple[str, int, int], Run] = {}
        self.poll_task: asyncio.Task | None = None

    def inventory(self) -> dict:
        return {
            "hostname": self.name,
            "address": f"{self.name}.bench",
            "source": "file",
            "gpus": [
                {"index": i, "uuid": f"GPU-{self.name}-{i}", "model": m, "memory_mib": 81559}
                for i, m in self.gpus
            ],
            "driver_version": "560.35.03",
            "cuda_version": "12.6",
            "runtimes": ["process"],
            "agent_version": "bench",
        }

    async def join(self) -> None:
        tries = 0
        while True:
            status, data, retry = await self.sim.request(
                "POST", "/v1/agent/join", "join", body={"token": self.token}
            )
            if status == 201:
                self.headers = {"Authorization": f"Bearer {data['credential']}"}
                break
            if 400 <= status < 500 and status != 429:
                raise RuntimeError(f"join of {self.name}: {status} {data}")
            tries += 1
            await self.sim.backoff(status, retry, tries)
        tries = 0
        while True:
            status, data, retry = await self.sim.request(
                "PUT",
                "/v1/agent/inventory",
                "inventory",
                headers=self.headers,
                body=self.inventory(),
            )
            if status == 200:
                if not data["matches"]:
                    raise RuntimeError(f"inventory of {self.name}: {data['differences']}")
                return
            if 400 <= status < 500 and status != 429:
                raise RuntimeError(f"inventory of {self.name}: {status} {data}")
            tries += 1
            await self.sim.backoff(status, retry, tries)

    async def poll_loop(self) -> None:
        sim, polls, tries = self.sim, 0, 0
        while not sim.stopping:
            # The first answers at once (index 0); the second waits a random while, so the
            # fleet's polls spread over the 30 s; then 30 s each.
            wait = POLL_WAIT_S if polls != 1 else sim.rng.randint(1, POLL_WAIT_S)
            status, data, retry = await sim.request(
                "GET",
                "/v1/agent/assignments",
                "assignments",
                headers=self.headers,
                params={"index": self.index, "wait": f"{wait}s"},
                timeout=wait + 60,
            )
            if status != 200:
                tries += 1
                await sim.backoff(status, retry, tries)
                continue
            tries = 0
            received = time.time()
            polls += 1
            if sim.stats.measuring:
                sim.stats.long_polls += 1
                sim.stats.long_polls_woken += data["index"] != self.index
            self.index = data["index"]
            self.heartbeat_s = data["heartbeat_s"]
            burn = data.get("burn_in")
            if burn and burn["id"] != self.burned:
                self.burned = burn["id"]
                self.sim.spawn(self.burn_in(burn))
            self.take(data["assignments"], received)

    async def burn_in(self, burn: dict) -> None:
        """The bring-up burn-in, as a host without DCGM or nccl-tests runs it: every step
        skipped (its tool is not installed), reported at once."""
        results = [
            {"name": s["name"], "status": "skipped", "seconds": 0.0, "detail": "not installed"}
            for s in burn["steps"]
        ]
        sim, tries = self.sim, 0
        while not sim.stopping:
            status, _data, retry = await sim.request(
                "POST",
                "/v1/agent/status",
                "burn_in",
                headers=self.headers,
                body={"burn_in": {"id": burn["id"], "results": results, "done": True}},
            )
            if 200 <= status < 300 or (400 <= status < 500 and status not in (408, 429)):
                sim.burned_in += 1
                if sim.burned_in >= len(sim.agents):
                    sim.all_burned_in.set()
                return
            tries += 1
            await sim.backoff(status, retry, tries)

    def take(self, assignments: list[dict], received: float) -> None:
        """What the node should run now: start the new runs, stop those asked to stop, forget
        those the control plane no longer holds."""
        started: list[Run] = []
        present = set()
        for a in assignments:
            key = (a["workload_id"], a["attempt"], a["replica"])
            present.add(key)
            run = self.runs.get(key)
            if a["desired"] == "run" and run is None:
                run = Run(*key, node=self.name, received=received, length=_run_length(a["command"]))
                self.runs[key] = self.sim.runs[key] = run
                started.append(run)
                run.exit_task = self.sim.spawn(self.exit_later(run))
            elif a["desired"] == "stop" and run is not None and not run.ended:
                if run.exit_task is not None:
                    run.exit_task.cancel()
                run.exit_task = self.sim.spawn(self.exit_now(run, stopped=True))
        for key in [k for k in self.runs if k not in present]:
            run = self.runs.pop(key)
            if not run.ended and run.exit_task is not None:
                run.exit_task.cancel()  # the control plane let it go (terminated, moved)
        if started:
            self.sim.spawn(self.report_started(started, received))

    def _report(self, run: Run, state: str, at: float, **extra: Any) -> dict:
        return {
            "workload_id": run.workload_id,
            "attempt": run.attempt,
            "replica": run.replica,
            "state": state,
            "at": _iso(at),
            **extra,
        }

    async def send(self, runs: list[dict], route: str) -> tuple[bool, float]:
        """POST /status until it is taken (or the bench stops); (taken, when it was sent)."""
        sim, tries, first = self.sim, 0, None
        while not sim.stopping:
            sent = time.time()
            first = first or sent
            status, data, retry = await sim.request(
                "POST", "/v1/agent/status", route, headers=self.headers, body={"runs": runs}
            )
            if 200 <= status < 300:
                if sim.stats.measuring:
                    sim.stats.status_reports += 1
                    sim.stats.run_reports += data.get("accepted", 0)
                    sim.stats.stale += data.get("stale", 0)
                return True, first
            if 400 <= status < 500 and status not in (408, 429):
                return False, first
            tries += 1
            await sim.backoff(status, retry, tries)
        return False, first or time.time()

    async def report_started(self, runs: list[Run], received: float) -> None:
        body = [self._report(r, "running", received, pid=1000 + r.replica) for r in runs]
        sent = time.time()
        for r in runs:
            r.sent = sent
        ok, _ = await self.send(body, "status_run")
        if ok:
            acked = time.time()
            for r in runs:
                r.acked = acked

    async def exit_later(self, run: Run) -> None:
        await asyncio.sleep(run.length)
        await self.exit_now(run)

    async def exit_now(self, run: Run, stopped: bool = False) -> None:
        while run.acked is None and not self.sim.stopping:  # its start is told first
            await asyncio.sleep(0.5)
        run.ended = True
        extra: dict[str, Any] = {"exit_code": 0, "stopped": stopped}
        await self.send([self._report(run, "exited", time.time(), **extra)], "status_exit")

    async def heartbeat_loop(self) -> None:
        await asyncio.sleep(self.sim.rng.random() * self.heartbeat_s)
        while not self.sim.stopping:
            ok, _ = await self.send([], "heartbeat")
            if ok and self.sim.stats.measuring:
                self.sim.stats.heartbeats += 1
            await asyncio.sleep(self.heartbeat_s)


# --- submissions -----------------------------------------------------------------------------


def workload_body(i: int, rng: random.Random) -> dict:
    length = rng.randint(10, 30)
    command = ["sleep", str(length)]
    kind = i % 5
    if kind < 3:
        return {"kind": "instance", "gpus": 1, "command": command, "max_runtime_s": 600}
    return {
        "kind": "job",
        "gpus": 8,
        "replicas": 1 if kind == 3 else 2,
        "command": command,
        "max_runtime_s": 600,
    }


async def submit(sim: Sim, key: str, rate: float, until: float, out: list) -> None:
    """Open loop: submission i leaves at t0 + i / rate whatever the earlier ones wait for."""
    rng = random.Random(7)
    headers = {"Authorization": f"Bearer {key}"}
    t0 = time.time()
    pending: list[asyncio.Task] = []

    async def one(i: int) -> None:
        t = time.time()
        status, data, _ = await sim.request(
            "POST", "/v1/workloads", "submit", headers=headers, body=workload_body(i, rng)
        )
        out.append((t, status, (data or {}).get("id") if status == 201 else None))

    i = 0
    while True:
        at = t0 + i / rate
        if at >= until:
            break
        delay = at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append(asyncio.get_running_loop().create_task(one(i)))
        i += 1
    await asyncio.gather(*pending, return_exceptions=True)


# --- what the database says --------------------------------------------------------------------


def _ts(at: datetime) -> float:
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def placements(engine) -> dict[tuple[str, int], dict[str, Any]]:
    """Each (workload, attempt): its placing time, its provisioning time, its replicas."""
    import sqlalchemy as sa

    with engine.connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT e.workload_id, e.seq, e.to_state, e.at, w.replicas FROM workload_events e "
                "JOIN workloads w ON w.id = e.workload_id WHERE e.kind = 'transition' "
                "AND e.to_state IN ('placing', 'provisioning') ORDER BY e.workload_id, e.seq"
            )
        ).all()
    out: dict[tuple[str, int], dict[str, Any]] = {}
    attempt: dict[str, int] = {}
    for wid, _seq, state, at, replicas in rows:
        wid = str(wid)
        if state == "placing":
            attempt[wid] = attempt.get(wid, 0) + 1
            out[(wid, attempt[wid])] = {"placing": _ts(at), "replicas": replicas}
        elif wid in attempt:
            out[(wid, attempt[wid])].setdefault("provisioning", _ts(at))
    return out


def db_rows(engine) -> dict[str, int]:
    """Rows written per table, and (as `:sessions`, `:commits`) the connections opened to the
    database and the transactions committed in it."""
    import sqlalchemy as sa

    with engine.connect() as c:
        out = {
            name: int(n)
            for name, n in c.execute(
                sa.text(
                    "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables"
                )
            )
        }
        sessions, commits = c.execute(
            sa.text(
                "SELECT sessions, xact_commit FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
        ).one()
    out[":sessions"], out[":commits"] = int(sessions), int(commits)
    return out


def states(engine) -> dict[str, int]:
    import sqlalchemy as sa

    with engine.connect() as c:
        return {
            s: int(n)
            for s, n in c.execute(sa.text("SELECT state, count(*) FROM workloads GROUP BY state"))
        }


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


# --- the run ---------------------------------------------------------------------------------


def run(
    agents: int = 1000,
    duration: float = 60.0,
    rate: float | None = None,
    warmup: float | None = None,
    api_max_in_flight: int | None = None,
    py_spy: Path | None = None,
    api_app: str = "app.main:app",
    log=print,
) -> dict[str, Any]:
    import sqlalchemy as sa

    started = time.perf_counter()
    rate = rate if rate is not None else default_rate(agents)
    warmup = warmup if warmup is not None else min(WARMUP_S, max(5.0, duration))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * agents + 1024))  # a socket per agent here and in the API
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    extra = {"RACKPLANE_PROCESS_POOLS": POOL}
    if api_max_in_flight is not None:
        extra["RACKPLANE_API_MAX_IN_FLIGHT"] = str(api_max_in_flight)
    env = ScratchDeployment(1, env=extra)
    try:
        key, nodes = seed(env, agents)
        url = start(env, api_app)
        api_pid = env.procs[0].pid
        worker_pids = [p.pid for p in env.procs[1:]]
        engine = sa.create_engine(env.env["DATABASE_URL"], pool_size=2)
        setup_s = time.perf_counter() - started
        log(f"setup {setup_s:.1f} s: {agents} nodes, API pid {api_pid}, {url}")
        try:  # the load generator's own CPU: uvloop's is well below asyncio's
            from uvloop import run as loop_run
        except ImportError:
            loop_run = asyncio.run
        result = loop_run(
            _load(
                url, key, nodes, engine, api_pid, worker_pids, rate, duration, warmup, py_spy, log
            )
        )
        result.update(
            agents=agents,
            rate=rate,
            api_max_in_flight=api_max_in_flight or env_default_in_flight(),
            **({} if api_app == "app.main:app" else {"api_app": api_app}),
            setup_s=round(setup_s, 1),
            warmup_s=warmup,
            seconds=round(time.perf_counter() - started, 1),
            at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        engine.dispose()
        return result
    finally:
        _stop_api(env)
        env.close()
        shutil.rmtree(env.dir, ignore_errors=True)  # the processes' logs (~3 MB at 1,000)


def _stop_api(env: ScratchDeployment) -> None:
    """The API first, without its graceful wait: long polls cut off by the agents' stop still
    run to their end inside it (up to 30 s) and nothing it holds is needed any more."""
    if not env.procs:
        return
    api = env.procs[0]
    api.terminate()
    try:
        api.wait(timeout=3)
    except subprocess.TimeoutExpired:
        api.kill()
        api.wait(timeout=5)


def median_run(runs: int, **kwargs: Any) -> dict[str, Any]:
    """`runs` repeats; the median of each number (the first run's tables), and each one's p99."""
    import statistics

    results = [run(**kwargs) for _ in range(runs)]
    if runs == 1:
        return results[0]
    out = dict(results[0])
    for k, v in results[0].items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            xs = [r[k] for r in results if r.get(k) is not None]
            out[k] = round(statistics.median(xs), 4) if xs else None
    out["repeats"] = runs
    out["assign_to_start_p99_s_each"] = [r["assign_to_start_p99_s"] for r in results]
    out["api_cpu_s_per_agent_minute_each"] = [r["api_cpu_s_per_agent_minute"] for r in results]
    out["errors_5xx_each"] = [r["errors_5xx"] for r in results]
    return out


def start(env: ScratchDeployment, api_app: str) -> str:
    """ScratchDeployment.start with one API process serving `api_app` (an A/B of a server
    change can run a wrapped app from PYTHONPATH without touching the tree), and one worker
    with beat, concurrency 1."""
    import httpx

    from workers.settings import worker_command

    port = free_port()
    argv = api_command(port, 1)
    argv[argv.index("app.main:app")] = api_app
    d = Path(env.dir)
    env.procs.append(
        subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env.env,
            stdout=open(d / "api.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    env.procs.append(
        subprocess.Popen(
            worker_command(f"w0@{env.name}", beat=True),
            cwd=ROOT,
            env=env.env,
            stdout=open(d / "worker0.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if env.procs[0].poll() is not None:
            raise RuntimeError(f"the API exited: {(d / 'api.log').read_text()[-2000:]}")
        time.sleep(0.2)
    while time.time() < deadline and b"ready" not in (d / "worker0.log").read_bytes():
        time.sleep(0.2)
    return url


def env_default_in_flight() -> int:
    from app.core.config import Settings

    return Settings.model_fields["api_max_in_flight"].default


async def _load(
    url: str,
    key: str,
    nodes: list,
    engine,
    api_pid: int,
    worker_pids: list[int],
    rate: float,
    duration: float,
    warmup: float,
    py_spy: Path | None,
    log,
) -> dict[str, Any]:
    sim = Sim(url, nodes)
    await sim.open()
    try:
        t = time.perf_counter()
        sim.stats.bringing_up = True
        await sim.join_all()
        join_s = time.perf_counter() - t
        log(f"joined {sim.joined} agents in {join_s:.1f} s")
        sim.start()

        async def bring_up_done() -> None:
            await sim.all_burned_in.wait()
            sim.stats.bringing_up = False
            bring_up["s"] = time.perf_counter() - t

        bring_up: dict[str, float] = {}
        watcher = asyncio.get_running_loop().create_task(bring_up_done())
        submitted: list[tuple[float, int, str | None]] = []
        t_submit = time.time()
        t0 = t_submit + warmup
        t_end = t0 + duration
        submitter = asyncio.get_running_loop().create_task(submit(sim, key, rate, t_end, submitted))
        await asyncio.sleep(max(0.0, t0 - time.time()))
        # --- the window -------------------------------------------------------------------
        spy = None
        if py_spy is not None:
            exe = shutil.which("py-spy") or "/tmp/pyspy/bin/py-spy"
            spy = subprocess.Popen(
                [
                    exe,
                    "record",
                    "-p",
                    str(api_pid),
                    "-d",
                    str(int(duration)),
                    "-r",
                    "50",
                    "-o",
                    str(py_spy),
                    "--format",
                    "speedscope",
                    "--nonblocking",
                    "--gil",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        rows0 = await asyncio.to_thread(db_rows, engine)
        sim.stats.measuring = True
        pg = postgres_pids()
        cpu0 = {
            "api": cpu_seconds([api_pid]),
            "worker": cpu_seconds(worker_pids),
            "bench": _own_cpu(),
            "machine": _machine_busy(),
        }
        pg0 = _each_cpu(pg)
        w0 = time.time()
        await asyncio.sleep(max(0.0, t_end - time.time()))
        wall = time.time() - w0
        cpu1 = {
            "api": cpu_seconds([api_pid]),
            "worker": cpu_seconds(worker_pids),
            "bench": _own_cpu(),
            "machine": _machine_busy(),
        }
        pg1 = _each_cpu(pg)
        # PostgreSQL: the server processes alive at both ends (one that exits meanwhile takes
        # its CPU seconds with it; the pool's short-lived backends are left out, so this is low)
        cpu0["pg"], cpu1["pg"] = 0.0, sum(pg1[p] - pg0[p] for p in pg1.keys() & pg0.keys())
        sim.stats.measuring = False
        rows1 = await asyncio.to_thread(db_rows, engine)
        rss = _rss(api_pid)
        await submitter
        # --- the drain: runs placed in the window may still be on their way to an agent -------
        deadline = time.time() + max(5.0, min(DRAIN_S, duration / 2))
        while True:
            placed = await asyncio.to_thread(placements, engine)
            due = [(k, v) for k, v in placed.items() if t0 <= v["placing"] < t_end]
            missing = sum(
                1
                for (wid, att), v in due
                for rep in range(v["replicas"])
                if (wid, att, rep) not in sim.runs or sim.runs[(wid, att, rep)].sent is None
            )
            if not missing or time.time() >= deadline:
                break
            await asyncio.sleep(1.0)
        observed_until = time.time()
        end_states = await asyncio.to_thread(states, engine)
        watcher.cancel()
        sim.stats.bringing_up = False
        if spy is not None:
            spy.wait(timeout=120)
    finally:
        await sim.stop()
        await sim.close()
    return _figures(
        sim,
        submitted,
        placed,
        t0,
        t_end,
        observed_until,
        wall,
        duration,
        cpu0,
        cpu1,
        rows0,
        rows1,
        join_s,
        end_states,
        rss,
        len(nodes),
        bring_up.get("s"),
    )


def _each_cpu(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _machine_busy() -> float:
    """CPU seconds the whole machine spent busy (every core, every process)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_cpu() -> float:
    """This process's CPU alone (cpu_seconds counts children: the API and worker are ours)."""
    t = os.times()
    return t.user + t.system


def _rss(pid: int) -> float | None:
    import psutil

    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error:
        return None


def _figures(
    sim: Sim,
    submitted: list,
    placed: dict,
    t0: float,
    t_end: float,
    observed_until: float,
    wall: float,
    duration: float,
    cpu0: dict,
    cpu1: dict,
    rows0: dict,
    rows1: dict,
    join_s: float,
    end_states: dict,
    rss: float | None,
    agents: int,
    bring_up_s: float | None = None,
) -> dict[str, Any]:
    st = sim.stats
    a2s, a2a, p2p, p2r, r2s, s2a = [], [], [], [], [], []
    unstarted = 0
    measured_workloads = 0
    for (wid, att), v in placed.items():
        if not t0 <= v["placing"] < t_end:
            continue
        measured_workloads += 1
        prov = v.get("provisioning")
        if prov is not None:
            p2p.append(prov - v["placing"])
        for rep in range(v["replicas"]):
            run = sim.runs.get((wid, att, rep))
            if run is None or run.sent is None:
                unstarted += 1
                a2s.append(observed_until - v["placing"])  # a lower bound
                continue
            a2s.append(run.sent - v["placing"])
            r2s.append(run.sent - run.received)
            if prov is not None:
                p2r.append(run.received - prov)
            if run.acked is not None:
                a2a.append(run.acked - v["placing"])
                s2a.append(run.acked - run.sent)
    minutes = agents * wall / 60
    delta = {t: rows1.get(t, 0) - rows0.get(t, 0) for t in rows1}
    sessions, commits = delta.pop(":sessions"), delta.pop(":commits")
    rows = sum(delta.values())
    codes = _by_route(st.codes)
    five = sum(n for (_, s), n in st.codes.items() if s.isdigit() and s.startswith("5"))
    failed = sum(n for (_, s), n in st.codes.items() if not s.isdigit())
    window_submits = [s for t, s, _ in submitted if t0 <= t < t_end]
    api = cpu1["api"] - cpu0["api"]
    lat = {
        route: {"p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99)}
        for route, xs in sorted(st.latency.items())
        if route != "assignments"
    }
    return {
        "agents": agents,
        "duration_s": round(wall, 1),
        "workloads": measured_workloads,
        "runs": len(a2s),
        "assign_to_start_p50_s": _pct(a2s, 0.5),
        "assign_to_start_p99_s": _pct(a2s, 0.99),
        "assign_to_start_max_s": _pct(a2s, 1.0),
        "assign_to_ack_p50_s": _pct(a2a, 0.5),
        "assign_to_ack_p99_s": _pct(a2a, 0.99),
        "runs_unstarted": unstarted,
        "placing_to_provisioning_p50_s": _pct(p2p, 0.5),
        "placing_to_provisioning_p99_s": _pct(p2p, 0.99),
        "provisioning_to_received_p50_s": _pct(p2r, 0.5),
        "provisioning_to_received_p99_s": _pct(p2r, 0.99),
        "received_to_sent_p99_s": _pct(r2s, 0.99),
        "sent_to_ack_p50_s": _pct(s2a, 0.5),
        "sent_to_ack_p99_s": _pct(s2a, 0.99),
        "api_cpu_s": round(api, 2),
        "api_cpu_share": round(api / wall, 3),
        "api_cpu_s_per_agent_minute": round(api / minutes, 5),
        "api_rss_mib": rss,
        "worker_cpu_share": round((cpu1["worker"] - cpu0["worker"]) / wall, 3),
        "postgres_cpu_share": round((cpu1["pg"] - cpu0["pg"]) / wall, 3),
        "bench_cpu_share": round((cpu1["bench"] - cpu0["bench"]) / wall, 3),
        # Everything else on the machine (2 cores here, shared with whatever else runs).
        "machine_busy_cores": round((cpu1["machine"] - cpu0["machine"]) / wall, 2),
        "other_cpu_share": round(
            (
                (cpu1["machine"] - cpu0["machine"])
                - sum(cpu1[k] - cpu0[k] for k in ("api", "worker", "pg", "bench"))
            )
            / wall,
            2,
        ),
        "cores": os.cpu_count(),
        "db_rows_per_agent_minute": round(rows / minutes, 2),
        "db_rows": rows,
        "db_rows_by_table": {
            t: n for t, n in sorted(delta.items(), key=lambda kv: -kv[1]) if n > 0
        },
        # Connections PostgreSQL accepted for the scratch database (the API's pool opening
        # connections beyond its size, and closing them again); transactions committed in it
        # (API, worker and this bench).
        "db_connections_opened": sessions,
        "db_commits_per_s": round(commits / wall, 1),
        "submitted": len(window_submits),
        "submit_rejected": sum(1 for s in window_submits if s != 201),
        "status_reports": st.status_reports,
        "heartbeats": st.heartbeats,
        "run_reports": st.run_reports,
        "stale_reports": st.stale,
        "long_polls": st.long_polls,
        "long_polls_woken": st.long_polls_woken,
        "requests_per_s": round(sum(st.codes.values()) / wall, 1),
        "errors_5xx": five,
        "errors_5xx_whole_run": sum(
            n for (_, s), n in st.codes_all.items() if s.isdigit() and s.startswith("5")
        ),
        "errors_no_answer": failed,
        "answers_by_route": codes,
        "latency_s_by_route": lat,
        "join_s": round(join_s, 1),
        # The bring-up burst (before the window, or into it if it lasts): every agent joins,
        # sends its inventory and reports its burn-in while heartbeats, long polls and
        # submissions run. None: not every burn-in report was taken by the end.
        "bring_up_s": round(bring_up_s, 1) if bring_up_s is not None else None,
        "bring_up_burned_in": sim.burned_in,
        "bring_up_5xx": sum(
            n for (_, s), n in st.codes_bring_up.items() if s.isdigit() and s.startswith("5")
        ),
        "bring_up_answers_by_route": _by_route(st.codes_bring_up),
        "bring_up_latency_s_by_route": {
            route: {"p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99)}
            for route, xs in sorted(st.latency_bring_up.items())
            if route != "assignments"
        },
        "end_states": end_states,
    }


def _by_route(counts: Counter) -> dict[str, dict[str, int]]:
    codes: dict[str, dict[str, int]] = defaultdict(dict)
    for (route, status), n in sorted(counts.items()):
        codes[route][status] = n
    return dict(codes)
