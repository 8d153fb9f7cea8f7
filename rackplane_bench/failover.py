"""`rackplane bench failover`: kill the parts of the HA topology (rackplane_bench/ha.py) with
SIGKILL while tenants work, record every request and its answer, then check the final state.

Load, for the whole run: three tenants, each submitting 1-GPU instances at a steady rate
(terminated through the API a couple of seconds after they run, so the fleet turns over and
usage starts and stops), creating an API key, setting its budget and reporting a checkpoint on a
running workload every few seconds; an operator pushes DCGM telemetry every second. The client
does what a load balancer and a careful SDK do: a request that finds an API process down goes
to the other, and a 503 is retried after its Retry-After with the same Idempotency-Key.

Faults, in turn, `gap` seconds apart: the PostgreSQL leader (its Patroni and PostgreSQL, as a
machine's loss), a Celery worker while it holds a region's placement lock (in the middle of a
placement cycle), the Redis master, one API process. Each killed part comes back (as a replica,
for the engines) before the next fault.

Checks on the final state (every figure must be 0 but the timings):
- `lost_acknowledged`: acknowledged submissions, keys, budgets and checkpoints not there;
- `double_allocations`: moments when a GPU held more than all of it, a MIG slice two claims;
- `duplicate_submissions`: one submission (its Idempotency-Key and label) applied twice;
- `usage_overlaps`: GPU-seconds billed twice (one replica's allocations billed over the same
  time, two start or stop events of one allocation, a stop without its start), and an
  allocation released but still billing;
- `stripe_overbilled`: usage Stripe holds beyond the ledger once the exporter caught up (the
  outbox sends each meter event once; one sent again is refused by its identifier and counted
  in `stripe_resent`);
- `errors_500`; `errors_503` counted apart (each attempt of a retried request).
`failover_s`: per fault, seconds from the kill to the first acknowledged write sent after it;
`placed_again_s`: to the next workload placed (what a worker's or the broker's loss delays);
`write_p99_ms`: the acknowledged writes' latency (each attempt's) before the first fault and
after each until the next.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rackplane_bench.deploy import fleet_yaml, pct, region_names
from rackplane_bench.ha import ROOT, Topology
from rackplane_bench.stripe_standin import StandIn, serve

FAULTS = ("postgres_leader", "worker", "redis_master", "api")
REGIONS = tuple(region_names(2))


SEED = """
import json, sys
from app.core.db import session_scope
from app.fleet import document
from app.fleet.service import apply_document
from app.tenants.service import create_tenant
from app.keys.service import create_key
out = {"tenants": {}}
with session_scope() as s:
    apply_document(s, document.load(sys.stdin.read()))
    for slug in ("acme", "globex", "initech"):
        t = create_tenant(s, name=slug.title(), slug=slug, contact_email=f"ops@{slug}.example",
                          status="active", isolation_policy=None)
        k = create_key(s, tenant_id=t.id, name="load", scopes=["read", "write", "admin"])
        out["tenants"][slug] = {"id": str(t.id), "key": k.key}
    op = create_key(s, tenant_id=None, name="operator", scopes=["platform"])
    out["operator"] = op.key
print(json.dumps(out))
"""


@dataclass
class Call:
    t: float  # when the answer came (time.time())
    tenant: str
    op: str  # submit | key | budget | checkpoint | terminate | telemetry
    status: int  # 0: no API process answered
    write: bool = True
    ms: float = 0.0  # the attempt's latency
    sent: float = 0.0  # when the attempt was sent


@dataclass
class Record:
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, c: Call) -> None:
        with self.lock:
            self.calls.append(c)


class Client:
    """Client-side balancing over the API processes, with retries a careful SDK makes: the
    next process when one does not answer, and the same Idempotency-Key again after a 503's
    Retry-After. Every attempt's answer is recorded."""

    def __init__(self, urls: list[str], key: str, tenant: str, record: Record):
        self.urls = urls
        self.tenant = tenant
        self.record = record
        self.http = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=20)
        self.turn = random.randrange(len(urls))

    def call(
        self, op: str, method: str, path: str, give_up: float = 90, **kw
    ) -> httpx.Response | None:
        headers = kw.pop("headers", {})
        if method != "GET":
            headers["Idempotency-Key"] = str(uuid.uuid4())
        deadline = time.time() + give_up
        while time.time() < deadline:
            self.turn = (self.turn + 1) % len(self.urls)
            t = time.time()
            try:
                r = self.http.request(method, self.urls[self.turn] + path, headers=headers, **kw)
            except httpx.TransportError:
                self.record.add(Call(time.time(), self.tenant, op, 0, method != "GET", 0.0, t))
                time.sleep(0.2)
                continue
            ms = (time.time() - t) * 1000
            self.record.add(
                Call(time.time(), self.tenant, op, r.status_code, method != "GET", ms, t)
            )
            busy = r.status_code == 409 and "idempotency_request_in_progress" in r.text
            if r.status_code == 503 or busy:
                time.sleep(min(float(r.headers.get("Retry-After", "1")), 2.0))
                continue
            return r
        return None


def _seed(topo: Topology, nodes_per_region: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", SEED],
        cwd=ROOT,
        env=topo.app_env(),
        input=fleet_yaml(nodes_per_region, len(REGIONS)),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"seeding failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Load:
    def __init__(self, topo: Topology, seeded: dict[str, Any], rate: float):
        self.topo = topo
        self.urls = topo.state.api_urls
        self.seeded = seeded
        self.rate = rate  # submissions per second per tenant
        self.record = Record()
        self.stop = threading.Event()
        # What was acknowledged, to look for at the end.
        self.acked: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for slug in self.seeded["tenants"]:
            for target in (self._submitter, self._churner, self._extras):
                self.threads.append(threading.Thread(target=target, args=(slug,), daemon=True))
        self.threads.append(threading.Thread(target=self._telemetry, daemon=True))
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _client(self, slug: str) -> Client:
        key = self.seeded["tenants"][slug]["key"] if slug != "operator" else self.seeded["operator"]
        return Client(self.urls, key, slug, self.record)

    def _submitter(self, slug: str) -> None:
        c = self._client(slug)
        i = 0
        t0 = time.time()
        while not self.stop.is_set():
            i += 1
            body = {"kind": "instance", "gpus": 1, "region": REGIONS[i % 2], "max_runtime_s": 600}
            # One label per submission, however many attempts it takes: the same label on two
            # workloads is one request applied twice.
            body["labels"] = {"submission": f"{slug}-{i}"}
            r = c.call("submit", "POST", "/v1/workloads", json=body)
            if r is not None and r.status_code == 201:
                self.acked["submit"].append((slug, r.json()["id"]))
            self.stop.wait(max(0.0, t0 + i / self.rate - time.time()))

    def _running(self, c: Client, older_than: float) -> list[dict]:
        r = c.call("list", "GET", "/v1/workloads", params={"state": "running", "limit": 100})
        if r is None or r.status_code != 200:
            return []
        now = time.time()
        out = []
        for w in r.json().get("items", []):
            started = w.get("started_at")
            if started and now - _ts(started) > older_than:
                out.append(w)
        return out

    def _churner(self, slug: str) -> None:
        """Terminate what has run two seconds, so usage starts and stops all along."""
        c = self._client(slug)
        while not self.stop.is_set():
            for w in self._running(c, 2.0):
                r = c.call("terminate", "DELETE", f"/v1/workloads/{w['id']}")
                if r is not None and r.status_code == 200:
                    self.acked["terminate"].append((slug, w["id"]))
            self.stop.wait(0.5)

    def _extras(self, slug: str) -> None:
        """Every few seconds: a key, a budget, a checkpoint of a running workload."""
        c = self._client(slug)
        n = 0
        while not self.stop.wait(3.0):
            n += 1
            r = c.call("key", "POST", "/v1/keys", json={"name": f"k{n}", "scopes": ["read"]})
            if r is not None and r.status_code == 201:
                self.acked["key"].append((slug, r.json()["id"]))
            limit = 1000 + n
            r = c.call("budget", "PUT", "/v1/budget", json={"gpu_hour_limit": limit})
            if r is not None and r.status_code == 200:
                self.acked["budget"].append((slug, limit))
            for w in self._running(c, 0.0)[:1]:
                body = {"size_bytes": 1 << 20, "step": n, "uri": f"s3://ckpt/{slug}/{n}"}
                r = c.call("checkpoint", "POST", f"/v1/workloads/{w['id']}/checkpoints", json=body)
                if r is not None and r.status_code == 201:
                    self.acked["checkpoint"].append((slug, (w["id"], n)))

    def _telemetry(self) -> None:
        c = self._client("operator")
        while not self.stop.wait(1.0):
            samples = [
                {"node": f"{r}-n{i}", "gpu": g, "field": "DCGM_FI_DEV_GPU_TEMP", "value": 55}
                for r in REGIONS
                for i in range(2)
                for g in range(8)
            ]
            c.call("telemetry", "POST", "/v1/admin/telemetry", json={"samples": samples})


def ok(c: Call) -> bool:
    return c.write and 200 <= c.status < 300


def _ts(s: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


# ----- faults ------------------------------------------------------------------------------


def _worker_in_cycle(topo: Topology, engine, timeout: float = 30.0) -> str | None:
    """The worker whose connection holds a region's placement lock right now (an advisory
    lock, held for the cycle's transaction), found by its client port."""
    import psutil
    import sqlalchemy as sa

    q = sa.text(
        "SELECT a.client_port FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted"
    )
    deadline = time.time() + timeout
    with engine.connect() as conn:
        while time.time() < deadline:
            ports = set(conn.execute(q).scalars())
            conn.rollback()
            if ports:
                for role in ("worker1", "worker2"):
                    try:
                        root = psutil.Process(topo.state.pids[role])
                        procs = [root, *root.children(recursive=True)]
                    except psutil.Error:
                        continue
                    for p in procs:
                        try:
                            conns = p.net_connections(kind="tcp")
                        except psutil.Error:
                            continue
                        if any(cn.laddr and cn.laddr.port in ports for cn in conns):
                            return role
            time.sleep(0.003)
    return None


def _inject(topo: Topology, fault: str, engine) -> tuple[float, str]:
    """Kill; the time of the kill and what was killed."""
    if fault == "postgres_leader":
        i = topo.kill_postgres_leader()
        return time.time(), f"pg{i + 1}"
    if fault == "worker":
        role = _worker_in_cycle(topo, engine)
        topo.kill(role or "worker1")
        return time.time(), role or "worker1 (no cycle seen in 30 s)"
    if fault == "redis_master":
        i = topo.kill_redis_master()
        return time.time(), f"redis{i + 1}"
    if fault == "api":
        topo.kill("api1")
        return time.time(), "api1"
    raise ValueError(fault)


def _restore(topo: Topology, fault: str, what: str) -> None:
    from workers.settings import worker_command

    what = what.split()[0]
    n = int(what[-1]) - 1
    if fault == "postgres_leader":
        topo.start_member(n)
    elif fault == "worker":
        topo._spawn(what, worker_command(f"w{n + 1}b@ha"), env=topo.app_env(), cwd=ROOT)
    elif fault == "redis_master":
        topo.start_redis(n)
    elif fault == "api":
        topo.start_api(n)


# ----- the final state -----------------------------------------------------------------------


def _lost(engine, acked: dict[str, list]) -> dict[str, int]:
    import sqlalchemy as sa

    lost = {}
    with engine.connect() as c:
        ids = {str(x) for x in c.execute(sa.text("SELECT id FROM workloads")).scalars()}
        lost["submit"] = sum(1 for _, w in acked["submit"] if w not in ids)
        keys = {str(x) for x in c.execute(sa.text("SELECT id FROM api_keys")).scalars()}
        lost["key"] = sum(1 for _, k in acked["key"] if k not in keys)
        last: dict[str, int] = {}
        for slug, v in acked["budget"]:
            last[slug] = v
        held = dict(
            c.execute(
                sa.text(
                    "SELECT t.slug, b.gpu_hour_limit FROM budgets b "
                    "JOIN tenants t ON t.id = b.tenant_id"
                )
            ).all()
        )
        lost["budget"] = sum(1 for slug, v in last.items() if held.get(slug) != v)
        points = {
            (str(w), int(s))
            for w, s in c.execute(
                sa.text(
                    "SELECT workload_id, (details->>'step')::int FROM workload_events "
                    "WHERE kind = 'checkpoint'"
                )
            ).all()
        }
        lost["checkpoint"] = sum(1 for _, p in acked["checkpoint"] if p not in points)
        states = dict(
            (str(w), s) for w, s in c.execute(sa.text("SELECT id, state FROM workloads")).all()
        )
        lost["terminate"] = sum(
            1 for _, w in acked["terminate"] if states.get(w) not in ("terminated", "terminating")
        )
    return lost


def _duplicates(engine) -> int:
    """Submissions applied more than once (their label on two workloads)."""
    import sqlalchemy as sa

    with engine.connect() as c:
        return int(
            c.scalar(
                sa.text(
                    "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM workloads "
                    "GROUP BY labels->>'submission' HAVING count(*) > 1) d"
                )
            )
        )


def _double_allocations(engine) -> int:
    """Sweep every GPU's allocation history (rows are never deleted): any moment it held more
    than 1000 milli, any moment a MIG slice had two claims."""
    import sqlalchemy as sa

    bad = 0
    per_gpu: dict[tuple, list[tuple[float, int]]] = defaultdict(list)
    per_slice: dict[tuple, list[tuple[float, int]]] = defaultdict(list)
    far = float("inf")
    with engine.connect() as c:
        for node, gpus, milli, created, released, mig in c.execute(
            sa.text(
                "SELECT node_id, gpu_indices, milli, created_at, released_at, mig_profile "
                "FROM allocations"
            )
        ).all():
            end = released.timestamp() if released else far
            for g in gpus:
                if mig is None:
                    per_gpu[(node, g)] += [(created.timestamp(), milli), (end, -milli)]
        for node, g, sl, created, released in c.execute(
            sa.text(
                "SELECT m.node_id, m.gpu_index, m.slice, a.created_at, m.released_at "
                "FROM mig_claims m JOIN allocations a ON a.id = m.allocation_id"
            )
        ).all():
            end = released.timestamp() if released else far
            per_slice[(node, g, sl)] += [(created.timestamp(), 1), (end, -1)]
        # What gpu_usage holds now must be what the live allocations hold.
        held = defaultdict(int)
        for node, gpus, milli in c.execute(
            sa.text(
                "SELECT node_id, gpu_indices, milli FROM allocations "
                "WHERE released_at IS NULL AND mig_profile IS NULL"
            )
        ).all():
            for g in gpus:
                held[(node, g)] += milli
        for node, g, used in c.execute(
            sa.text("SELECT node_id, gpu_index, milli_used FROM gpu_usage WHERE milli_used > 0")
        ).all():
            bad += held.pop((node, g), 0) != used
        bad += sum(1 for v in held.values() if v)
    for events, cap in ((per_gpu, 1000), (per_slice, 1)):
        for evs in events.values():
            level = 0
            for _, d in sorted(evs, key=lambda e: (e[0], e[1])):  # releases first at a tie
                level += d
                bad += level > cap
    return bad


def _usage_overlaps(engine) -> int:
    import sqlalchemy as sa

    bad = 0
    with engine.connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT e.allocation_id, e.kind, e.occurred_at, a.workload_id, a.replica, "
                "a.released_at FROM usage_events e JOIN allocations a ON a.id = e.allocation_id "
                "WHERE e.kind IN ('start', 'stop')"
            )
        ).all()
    by_alloc: dict[Any, dict[str, list]] = defaultdict(lambda: {"start": [], "stop": []})
    owner = {}
    released = {}
    for alloc, kind, at, wid, replica, rel in rows:
        by_alloc[alloc][kind].append(at.timestamp())
        owner[alloc] = (wid, replica)
        released[alloc] = rel
    spans: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for alloc, ev in by_alloc.items():
        if len(ev["start"]) != 1 or len(ev["stop"]) > 1:
            bad += 1
            continue
        if released[alloc] is not None and not ev["stop"]:
            bad += 1  # released, still billing
        end = ev["stop"][0] if ev["stop"] else float("inf")
        if end < ev["start"][0]:
            bad += 1
        spans[owner[alloc]].append((ev["start"][0], end))
    for ss in spans.values():
        ss.sort()
        for (_, e1), (s2, _) in zip(ss, ss[1:], strict=False):
            bad += s2 < e1
    return bad


def _stripe_against_ledger(urls: list[str], operator: str, stripe: StandIn) -> dict[str, Any]:
    """Once the exporter has caught up (reconciliation: nothing pending, no difference), what
    Stripe holds per customer and meter for the closed buckets against the ledger:
    `stripe_overbilled` (milli-GPU-ms Stripe holds beyond the ledger: billed twice) and
    `stripe_unbilled` (the ledger's usage Stripe does not hold); `stripe_resent` counts meter
    events sent again with an identifier Stripe already had (refused: never billed twice)."""
    from datetime import UTC, datetime

    period = datetime.now(UTC).strftime("%Y-%m")
    headers = {"Authorization": f"Bearer {operator}"}
    rec: dict[str, Any] = {}
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            r = httpx.get(
                f"{urls[-1]}/v1/admin/billing/reconciliation",
                params={"period": period},
                headers=headers,
                timeout=10,
            )
            rec = r.json() if r.status_code == 200 else {}
        except httpx.HTTPError:
            rec = {}
        rows = rec.get("rows", [])
        if rows and not rec["differences"] and not any(x["pending_events"] for x in rows):
            break
        time.sleep(2)
    through = _ts(rec["through"]) if rec.get("through") else 0.0
    with stripe.lock:
        held: dict[tuple[str, str], int] = defaultdict(int)
        for e in stripe.events.values():
            if not e.cancelled and e.timestamp < through:
                held[(e.customer, e.event_name)] += e.value
        resent = stripe.duplicates
    over = unbilled = 0
    for row in rec.get("rows", []):
        got = held.get((row["stripe_customer_id"], row["meter"]), 0)
        owed = row["ledger_milli_gpu_ms"] - row["adjusted_milli_gpu_ms"]
        over += max(0, got - owed)
        unbilled += max(0, owed - got)
    return {
        "stripe_overbilled": over,
        "stripe_unbilled": unbilled,
        "stripe_resent": resent,
        "stripe_events": len(stripe.events),
        "billed_milli_gpu_ms": sum(held.values()),
    }


def _settle(engine, timeout: float = 90) -> bool:
    """Wait until nothing is half-way: no workload placing, provisioning or terminating, and
    every released allocation's usage stopped."""
    import sqlalchemy as sa

    q = sa.text(
        "SELECT (SELECT count(*) FROM workloads WHERE state IN "
        "('placing', 'provisioning', 'terminating')) + "
        "(SELECT count(*) FROM allocations a WHERE a.released_at IS NOT NULL AND NOT EXISTS "
        "(SELECT 1 FROM usage_events e WHERE e.allocation_id = a.id AND e.kind = 'stop'))"
    )
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with engine.connect() as c:
                if c.scalar(q) == 0:
                    return True
        except sa.exc.OperationalError:
            pass
        time.sleep(1)
    return False


def _placements_after(engine, t: float) -> float | None:
    import sqlalchemy as sa

    with engine.connect() as c:
        at = c.scalar(
            sa.text(
                "SELECT min(at) FROM workload_events WHERE to_state = 'placing' "
                "AND at > to_timestamp(:t)"
            ),
            {"t": t},
        )
    return at.timestamp() - t if at else None


def _settings(stripe_url: str) -> dict[str, str]:
    """The deployment's environment for the run."""
    return {
        # The limiter runs but never refuses the load: the run measures failover, not limits.
        "RACKPLANE_RATE_LIMITS": "read=100000/s,write=100000/s,expensive=100000/s",
        "RACKPLANE_STRIPE_API_KEY": "sk_test_failover",
        "RACKPLANE_STRIPE_API_BASE": stripe_url,
        "RACKPLANE_METER_BUCKET": "10",
        "RACKPLANE_METER_SETTLE": "2",
        "RACKPLANE_METER_EXPORT_EVERY": "2",
    }


def _kill_in_turn(
    topo: Topology, faults: tuple[str, ...], engine, gap: float
) -> list[tuple[str, float, str]]:
    """Each fault in turn, `gap` seconds apart, its part back half way: (fault, when, what)."""
    kills: list[tuple[str, float, str]] = []
    for fault in faults:
        at, what = _inject(topo, fault, engine)
        kills.append((fault, at, what))
        time.sleep(gap / 2)
        _restore(topo, fault, what)
        time.sleep(gap / 2)
    return kills


def _per_fault(
    result: dict[str, Any],
    engine,
    calls: list[Call],
    kills: list[tuple[str, float, str]],
    gap: float,
) -> None:
    """Per fault: failover and placed-again seconds, the write p99 until the next, the part."""
    for fault, at, what in kills:
        # Sent after the kill: an answer to a request committed before it proves nothing.
        nxt = min((c.t for c in calls if c.sent > at and ok(c)), default=None)
        result["failover_s"][fault] = round(nxt - at, 2) if nxt else None
        placed = _placements_after(engine, at)
        result["placed_again_s"][fault] = round(placed, 2) if placed is not None else None
        # What the fault did to latency: acknowledged writes' p99 until the next fault.
        window = [c.ms for c in calls if at <= c.t <= at + gap and ok(c)]
        result["write_p99_ms"][fault] = round(pct(window, 0.99), 1) if window else None
        result["killed"][fault] = what


def _figures(
    faults: tuple[str, ...],
    engine,
    load: Load,
    kills: list[tuple[str, float, str]],
    gap: float,
    settled: bool,
    billed: dict[str, Any],
) -> dict[str, Any]:
    """The checks on the final state and the timings (see the module's docstring)."""
    calls = sorted(load.record.calls, key=lambda c: c.t)
    result: dict[str, Any] = {
        "faults": list(faults),
        "requests": len(calls),
        "acknowledged": {k: len(v) for k, v in load.acked.items()},
        "lost_acknowledged": 0,
        "double_allocations": _double_allocations(engine),
        "duplicate_submissions": _duplicates(engine),
        "usage_overlaps": _usage_overlaps(engine),
        **billed,
        "errors_503": sum(c.status == 503 for c in calls),
        "errors_500": sum(c.status >= 500 and c.status != 503 for c in calls),
        "unanswered": sum(c.status == 0 for c in calls),
        "failover_s": {},
        "placed_again_s": {},
        "write_p99_ms": {},
        "killed": {},
        "settled": settled,
    }
    first = kills[0][1] if kills else float("inf")
    result["write_p99_ms"]["before"] = round(
        pct([c.ms for c in calls if c.t < first and ok(c)], 0.99), 1
    )
    lost = _lost(engine, load.acked)
    result["lost_acknowledged"] = sum(lost.values())
    result["lost_by_kind"] = lost
    _per_fault(result, engine, calls, kills, gap)
    return result


def run(
    faults: tuple[str, ...] = FAULTS,
    rate: float = 2.0,
    gap: float = 25.0,
    warmup: float = 10.0,
    tail: float = 15.0,
    root: Path | None = None,
) -> dict[str, Any]:
    """The topology up, the load on, each fault in turn, then the checks (see the module)."""
    import sqlalchemy as sa

    # Not under a private parent (pytest's tmp_path is one): PostgreSQL runs as postgres.
    scratch = root is None
    root = Path(root or tempfile.mkdtemp(prefix="rackplane-ha-"))
    # Stripe is the local stand-in; usage goes out in 10-second buckets, so what the run
    # meters is exported (and checked against the ledger) within it.
    stripe = StandIn()
    server, stripe_url = serve(stripe)
    topo = Topology(root, env=_settings(stripe_url))
    started = time.time()
    try:
        topo.start()
        up_s = time.time() - started
        seeded = _seed(topo, nodes_per_region=8)
        engine = sa.create_engine(topo.state.database_url, pool_pre_ping=True)
        load = Load(topo, seeded, rate)
        load.start()
        time.sleep(warmup)
        kills = _kill_in_turn(topo, faults, engine, gap)
        time.sleep(tail)
        load.finish()
        settled = _settle(engine)
        billed = _stripe_against_ledger(topo.state.api_urls, seeded["operator"], stripe)
        result = _figures(faults, engine, load, kills, gap, settled, billed)
        result["topology_up_s"] = round(up_s, 1)
        result["seconds"] = round(time.time() - started, 1)
        engine.dispose()
        topo.stop()
        if scratch:
            shutil.rmtree(root, ignore_errors=True)  # kept when the run fails, for its logs
        return result
    finally:
        topo.stop()  # a second stop finds nothing left to stop
        server.shutdown()
