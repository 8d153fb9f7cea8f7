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

The simulated agents and the submissions are in rackplane_bench/agents_sim.py; what is read
from the database, the processes and the machine, and the figures, in agents_figures.py.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rackplane_bench.agents_figures import (
    Window,
    db_rows,
    each_cpu,
    figures,
    machine_busy,
    own_cpu,
    placements,
    rss_mib,
    states,
)
from rackplane_bench.agents_sim import Sim, submit
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
    """The agents join and run while work is submitted; the window is measured, then the
    drain waits for the runs placed in it (see the module's docstring)."""
    sim = Sim(url, nodes)
    await sim.open()
    try:
        t = time.perf_counter()
        sim.stats.bringing_up = True
        await sim.join_all()
        join_s = time.perf_counter() - t
        log(f"joined {sim.joined} agents in {join_s:.1f} s")
        sim.start()
        bring_up: dict[str, float] = {}
        watcher = asyncio.get_running_loop().create_task(_bring_up_done(sim, t, bring_up))
        submitted: list[tuple[float, int, str | None]] = []
        t_submit = time.time()
        t0 = t_submit + warmup
        t_end = t0 + duration
        submitter = asyncio.get_running_loop().create_task(submit(sim, key, rate, t_end, submitted))
        await asyncio.sleep(max(0.0, t0 - time.time()))
        spy = _py_spy(py_spy, api_pid, duration)
        window = await _measure(sim, engine, api_pid, worker_pids, t0, t_end)
        await submitter
        placed = await _drain(sim, engine, window, duration)
        end_states = await asyncio.to_thread(states, engine)
        watcher.cancel()
        sim.stats.bringing_up = False
        if spy is not None:
            spy.wait(timeout=120)
    finally:
        await sim.stop()
        await sim.close()
    return figures(
        sim, window, submitted, placed, join_s, end_states, len(nodes), bring_up.get("s")
    )


async def _bring_up_done(sim: Sim, t: float, bring_up: dict[str, float]) -> None:
    """Once every agent's burn-in report was taken: the bring-up's seconds since `t`."""
    await sim.all_burned_in.wait()
    sim.stats.bringing_up = False
    bring_up["s"] = time.perf_counter() - t


def _py_spy(out: Path | None, api_pid: int, duration: float) -> subprocess.Popen | None:
    """py-spy recording the API over the window into `out` (speedscope), if asked."""
    if out is None:
        return None
    exe = shutil.which("py-spy") or "/tmp/pyspy/bin/py-spy"
    return subprocess.Popen(
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
            str(out),
            "--format",
            "speedscope",
            "--nonblocking",
            "--gil",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _cpu_now(api_pid: int, worker_pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the API, the worker, this process and the whole machine."""
    return {
        "api": cpu_seconds([api_pid]),
        "worker": cpu_seconds(worker_pids),
        "bench": own_cpu(),
        "machine": machine_busy(),
    }


async def _measure(
    sim: Sim, engine, api_pid: int, worker_pids: list[int], t0: float, t_end: float
) -> Window:
    """The window: the counters count, and CPU and rows written are read at both ends."""
    rows0 = await asyncio.to_thread(db_rows, engine)
    sim.stats.measuring = True
    pg = postgres_pids()
    cpu0 = _cpu_now(api_pid, worker_pids)
    pg0 = each_cpu(pg)
    w0 = time.time()
    await asyncio.sleep(max(0.0, t_end - time.time()))
    wall = time.time() - w0
    cpu1 = _cpu_now(api_pid, worker_pids)
    pg1 = each_cpu(pg)
    # PostgreSQL: the server processes alive at both ends (one that exits meanwhile takes
    # its CPU seconds with it; the pool's short-lived backends are left out, so this is low)
    cpu0["pg"], cpu1["pg"] = 0.0, sum(pg1[p] - pg0[p] for p in pg1.keys() & pg0.keys())
    sim.stats.measuring = False
    rows1 = await asyncio.to_thread(db_rows, engine)
    return Window(t0, t_end, wall, cpu0, cpu1, rows0, rows1, rss_mib(api_pid))


async def _drain(sim: Sim, engine, window: Window, duration: float) -> dict:
    """Runs placed in the window may still be on their way to an agent: wait until each was
    reported or the drain is over (`window.observed_until`). The placements."""
    deadline = time.time() + max(5.0, min(DRAIN_S, duration / 2))
    while True:
        placed = await asyncio.to_thread(placements, engine)
        due = [(k, v) for k, v in placed.items() if window.t0 <= v["placing"] < window.t_end]
        missing = sum(
            1
            for (wid, att), v in due
            for rep in range(v["replicas"])
            if (wid, att, rep) not in sim.runs or sim.runs[(wid, att, rep)].sent is None
        )
        if not missing or time.time() >= deadline:
            break
        await asyncio.sleep(1.0)
    window.observed_until = time.time()
    return placed
