"""The simulated node agents of `rackplane bench agents` (rackplane_bench/agents.py), and its
open-loop submissions: one asyncio event loop, aiohttp (its pool costs O(1) per request with a
thousand long polls waiting, httpx's does not).

Each agent joins with its token and sends its inventory, long-polls its assignments for ever,
heartbeats, reports its bring-up burn-in (every step skipped: no DCGM or nccl-tests here) and
each run it is given as `running` at once and `exited` after the command's `sleep`. A report
that fails is sent again after a back-off (Retry-After on 503), as the real agent does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

POLL_WAIT_S = 30
JOIN_CONCURRENCY = 16


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
