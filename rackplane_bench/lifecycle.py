"""`rackplane bench lifecycle`: submit-to-placed latency through the real path.

A scratch PostgreSQL database and Redis key prefix, a uvicorn API (two processes), N Celery
worker processes (the first also runs beat) of `concurrency` pool processes each, a fleet of two
regions (two partitions), and an open-loop load: submissions at a fixed rate, alternating
regions, and (with churn, the default) each one terminated through the API a second after it
runs, so the fleet turns over instead of filling. Submit-to-placed is the time from sending the
POST to the workload's `placing` event (same machine, same clock).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import httpx

from rackplane_bench.deploy import (
    ScratchDeployment,
    cpu_seconds,
    pct,
    postgres_pids,
    region_names,
)


def run(
    workers: int,
    rate: float,
    duration: float,
    churn: bool = True,
    warmup: float = 5.0,
    concurrency: int = 1,
) -> dict[str, Any]:
    """`warmup` seconds of the same load come first and are left out of the figures: the
    target is a sustained rate, and the first requests pay for cold processes (connection
    pools filling, compiled-statement caches, the workers' first full read of each region)."""
    started = time.perf_counter()
    env = ScratchDeployment(workers, concurrency=concurrency)
    try:
        n = int(rate * warmup) + int(rate * duration)
        key, _ = env.seed(nodes_per_region=max(8, -(-n // 16) + 4))
        url = env.start()
        out: dict[str, Any] = {"workers": workers, "concurrency": concurrency, "partitions": 2}
        out |= offer(env, url, key, rate, duration, churn, warmup, region_names(2))
        out["seconds"] = round(time.perf_counter() - started, 1)
        return out
    finally:
        env.close()


@dataclass
class _Sent:
    """What the load sent: each measured submission's id and send time, the API's answer
    times, and the submissions refused or unanswered."""

    at: dict[str, float] = field(default_factory=dict)
    api_ms: list[float] = field(default_factory=list)
    errors: int = 0


def offer(
    env: ScratchDeployment,
    url: str,
    key: str,
    rate: float,
    duration: float,
    churn: bool,
    warmup: float,
    regions: list[str],
) -> dict[str, Any]:
    """The open-loop load on a started deployment: submissions at `rate` for `warmup` +
    `duration` seconds, in turn over `regions`, and the figures of the measured ones."""
    import sqlalchemy as sa

    warm = int(rate * warmup)
    n = warm + int(rate * duration)
    engine = sa.create_engine(env.env["DATABASE_URL"])
    try:
        headers = {"Authorization": f"Bearer {key}"}
        stop = threading.Event()
        client = httpx.Client(
            base_url=url, headers=headers, timeout=30, limits=httpx.Limits(max_connections=64)
        )
        churner = threading.Thread(
            target=_terminate_running, args=(engine, client, stop), daemon=True
        )
        if churn:
            churner.start()
        cycles0 = env.cycles()
        t0 = time.time() + 0.5
        sent = _Sent()
        asyncio.run(_load(url, headers, regions, rate, n, warm, t0, sent))
        load_s = time.time() - t0
        got = _wait_placed(engine, sent.at)
        cycles = env.cycles() - cycles0
        stop.set()
        if churn:
            churner.join(timeout=5)
        out: dict[str, Any] = {"rate": rate, "churn": churn, "duration_s": duration}
        return out | _figures(sent, got, t0, warmup, n, load_s, cycles)
    finally:
        engine.dispose()


async def _load(
    url: str,
    headers: dict[str, str],
    regions: list[str],
    rate: float,
    n: int,
    warm: int,
    t0: float,
    sent: _Sent,
) -> None:
    """Open loop on one event loop: each submission leaves at its scheduled time, whatever
    the earlier ones are waiting for (threads cost the load generator a core this machine
    does not have). aiohttp, because httpx's async pool costs O(waiting) per request and ate
    a core at 100/s. The first `warm` are not measured."""
    import aiohttp

    async with aiohttp.ClientSession(
        base_url=url,
        headers=headers,
        connector=aiohttp.TCPConnector(limit=256),
        timeout=aiohttp.ClientTimeout(total=60),
    ) as ac:

        async def one(i: int) -> None:
            delay = t0 + i / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t = time.time()
            body = {
                "kind": "instance",
                "gpus": 1,
                "region": regions[i % len(regions)],
                "max_runtime_s": 600,
            }
            try:
                async with ac.post("/v1/workloads", json=body) as r:
                    status, out = r.status, await r.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError):
                sent.errors += i >= warm
                return
            if i < warm:  # warming up: not measured
                return
            sent.api_ms.append((time.time() - t) * 1000)
            if status == 201:
                sent.at[out["id"]] = t
            else:
                sent.errors += 1

        await asyncio.gather(*(one(i) for i in range(n)))


def _terminate_running(engine, client: httpx.Client, stop: threading.Event) -> None:
    """Terminate what has run for a second, so the fleet keeps turning over."""
    import sqlalchemy as sa

    while not stop.is_set():
        with engine.connect() as c:
            rows = (
                c.execute(
                    sa.text(
                        "SELECT id FROM workloads WHERE state = 'running' "
                        "AND started_at < now() - interval '1 second' LIMIT 100"
                    )
                )
                .scalars()
                .all()
            )
        for wid in rows:
            try:
                client.delete(f"/v1/workloads/{wid}")
            except httpx.HTTPError:
                return  # the API is shutting down
        stop.wait(0.3)


def _placed(engine) -> dict[str, float]:
    """Each workload's first `placing` event, as a timestamp."""
    import sqlalchemy as sa

    with engine.connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT workload_id, min(at) FROM workload_events "
                "WHERE to_state = 'placing' GROUP BY workload_id"
            )
        ).all()
    return {
        str(w): at.replace(tzinfo=UTC).timestamp() if at.tzinfo is None else at.timestamp()
        for w, at in rows
    }


def _wait_placed(engine, sent: dict[str, float]) -> dict[str, float]:
    """The placing times, once every measured submission has one (a minute at most)."""
    deadline = time.time() + 60
    got = _placed(engine)
    while time.time() < deadline and len([w for w in sent if w in got]) < len(sent):
        time.sleep(0.5)
        got = _placed(engine)
    return got


def _figures(
    sent: _Sent,
    got: dict[str, float],
    t0: float,
    warmup: float,
    n: int,
    load_s: float,
    cycles: int,
) -> dict[str, Any]:
    """Submit-to-placed latencies and rates of the measured submissions."""
    at = sent.at
    lat = [(got[w] - s) * 1000 for w, s in at.items() if w in got]
    first = min(at.values(), default=t0)
    last = max((got[w] for w in at if w in got), default=first)
    return {
        "warmup_s": warmup,
        "submitted": len(at),
        "rejected": sent.errors,
        "placed": len(lat),
        "p50_submit_to_placed_ms": round(pct(lat, 0.5), 1),
        "p99_submit_to_placed_ms": round(pct(lat, 0.99), 1),
        "max_submit_to_placed_ms": round(max(lat, default=float("nan")), 1),
        "p99_submit_api_ms": round(pct(sent.api_ms, 0.99), 1),
        "placements_per_s": round(len(lat) / max(last - first, 1e-9), 1),
        "offered_per_s": round(n / max(load_s, 1e-9), 1),
        "cycles_per_s": round(cycles / max(last - first, 1e-9), 1),
    }


def run_api(requests: int, warmup: int = 300) -> dict[str, Any]:
    """CPU per request of the API's hot routes, one at a time on one API process: POST, GET
    and DELETE of `/v1/workloads`. CPU (user + system, from the kernel's accounting) rather
    than wall time, so the figure says what each request costs the machine whatever else it
    runs; PostgreSQL's and the worker's CPU in the same interval are reported beside it (the
    worker's includes the placement cycles and provisioning each request causes)."""
    started = time.perf_counter()
    env = ScratchDeployment(1)
    try:
        key, _ = env.seed(nodes_per_region=max(8, -(-(requests + warmup) // 8) + 4))
        url = env.start(api_processes=1)
        api, workers = [env.procs[0].pid], [p.pid for p in env.procs[1:]]
        body = {"kind": "instance", "gpus": 1, "region": "r1", "max_runtime_s": 600}
        out: dict[str, Any] = {"requests": requests}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            for _ in range(warmup):
                c.post("/v1/workloads", json=body).raise_for_status()
            time.sleep(2)
            ids: list[str] = []
            calls = {
                "post": lambda i: c.post("/v1/workloads", json=body),
                "get": lambda i: c.get(f"/v1/workloads/{ids[i]}"),
                "delete": lambda i: c.delete(f"/v1/workloads/{ids[i]}"),
            }
            for route, call in calls.items():
                pg = postgres_pids()
                a, p, w, t = (
                    cpu_seconds(api),
                    cpu_seconds(pg),
                    cpu_seconds(workers),
                    time.perf_counter(),
                )
                for i in range(requests):
                    r = call(i)
                    r.raise_for_status()
                    if route == "post":
                        ids.append(r.json()["id"])
                wall = time.perf_counter() - t
                time.sleep(1.5)  # the work the requests caused (cycles, provisioning) settles
                ms = 1000 / requests
                out[f"{route}_wall_ms"] = round(wall * ms, 2)
                out[f"{route}_api_cpu_ms"] = round((cpu_seconds(api) - a) * ms, 2)
                out[f"{route}_pg_cpu_ms"] = round((cpu_seconds(pg) - p) * ms, 2)
                out[f"{route}_worker_cpu_ms"] = round((cpu_seconds(workers) - w) * ms, 2)
        out["seconds"] = round(time.perf_counter() - started, 1)
        return out
    finally:
        env.close()
