"""`rackplane bench graphql`: the portal's queries against a real API process on a scratch
PostgreSQL database: the dashboard query of a tenant with 10,000 workloads, and the operator's
fleet query over a 10,000-GPU fleet. Latency is measured by the client, one query at a time;
SQL statements per query are counted in-process on the same database (they do not depend on
the process)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from rackplane_bench.deploy import ROOT, ScratchDeployment, pct

DASHBOARD = """
query Dashboard {
  viewer { slug status isolationPolicy }
  quotas { gpuModel guaranteedMilli limitMilli usedMilli queuedMilli }
  upcomingBill { accruedUntil totals { currency amount } unpricedMilliGpuMs
                 lines { sku tier gpuHours amount currency } }
  workloads(first: 50) {
    edges { node { id name state kind tier gpuMilli createdAt
                   placement { region rack node gpuIndices migProfile migSlot }
                   events { seq toState reason at } } }
    pageInfo { hasNextPage endCursor }
  }
}
"""
FLEET = """
query Fleet($first: Int!) {
  nodes(first: $first) {
    edges { node { name rack region state health
                   gpus { index health perf holders { tenantId workloadId tier milli } } } }
    pageInfo { hasNextPage endCursor }
  }
}
"""

# Seeds the scratch database in a child process: an operator key, and `n` workloads of the
# bench tenant inserted as the service writes them (queued, then placed on the fleet's
# nodes with their placement record and live allocation, one GPU each), three events each,
# and this month's ledger (three usage events each), a price and a quota. (Until 2026-11-26
# the allocations were built but not inserted: quotas held nothing, GPUs had no holders.)
_SEED = r"""
import json, sys, uuid
from datetime import timedelta
from sqlalchemy import select
from app.core.db import insert_objects, session_scope, utcnow
from app.models.fleet import Node, Rack, Region
from app.keys.service import create_key
from app.models.tenants import Tenant
from app.billing.service import create_price
from app.models.metering import UsageEvent
from app.models.workloads import Allocation, TenantQuota, Workload, WorkloadEvent, WorkloadShape

n = int(sys.argv[1])
with session_scope() as s:
    op = create_key(s, tenant_id=None, name="bench-op", scopes=["platform"]).key
    t = s.scalar(select(Tenant).where(Tenant.slug == "bench"))
    nodes = s.execute(
        select(Node.name, Rack.name, Region.name, Node.gpu_model, Node.id)
        .join(Rack, Node.rack_id == Rack.id).join(Region, Rack.region_id == Region.id)
    ).all()
    now = utcnow()
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    model = nodes[0][3]
    create_price(s, gpu_model=model, shape="whole", tier="*", region="*", plan="on_demand",
                 currency="usd", unit_amount=250, effective_from=month - timedelta(days=31))
    s.add(TenantQuota(tenant_id=t.id, gpu_model=model, guaranteed_milli=64_000,
                      limit_milli=None, weight=1.0))
    # This month's ledger: each workload's allocation starts as it starts to run (the running
    # work the upcoming bill accrues up to now), after an earlier one of an hour that ended.
    ws, evs, usage, allocs = [], [], [], []
    for i in range(n):
        node, rack, region, _, node_id = nodes[i % len(nodes)]
        at = now - timedelta(seconds=n - i)
        wid = uuid.uuid4()
        ws.append(Workload(
            id=wid, tenant_id=t.id, name=f"w{i}", kind="instance", state="running",
            tier="dedicated", priority="training", shape=WorkloadShape(gpus=1), replicas=1,
            gpu_milli=1000, region=region, max_runtime_s=86400, labels={"team": "a"},
            placement=[{"replica": 0, "region": region, "rack": rack, "node": node,
                        "gpu_indices": [i % 8], "gpu_model": model, "mig_profile": None,
                        "mig_start": None, "milli": None, "gpu_milli": 1000}],
            created_at=at, started_at=at, generation=1, changed_xid=0,
            last_event_seq=3,
        ))
        for seq, (frm, to) in enumerate(
            [(None, "pending"), ("pending", "queued"), ("queued", "running")], start=1
        ):
            evs.append(WorkloadEvent(
                workload_id=wid, tenant_id=t.id, seq=seq, kind="transition",
                from_state=frm, to_state=to, reason=to, details={}, at=at,
            ))
        allocs.append(Allocation(
            workload_id=wid, tenant_id=t.id, node_id=node_id, replica=0, tier="dedicated",
            gpu_indices=[i % 8], milli=1000, created_at=at,
        ))
        early = month + max(at - month - timedelta(hours=1), timedelta(0)) * 0.5
        for key, kind, when in ((f"early:{wid}:start", "start", early),
                                (f"early:{wid}:stop", "stop", early + timedelta(hours=1)),
                                (f"alloc:{wid}:start", "start", at)):
            alloc = wid if key.startswith("alloc") else uuid.uuid5(wid, "early")
            usage.append(UsageEvent(
                event_key=key, kind=kind, allocation_id=alloc, workload_id=wid,
                tenant_id=t.id, region=region, gpu_model=model, shape="whole",
                tier="dedicated", priority="training", gpu_milli=1000, occurred_at=when,
            ))
        if len(ws) >= 2000:
            for batch in (ws, evs, usage, allocs):
                insert_objects(s, batch)
            ws, evs, usage, allocs = [], [], [], []
    for batch in (ws, evs, usage, allocs):
        insert_objects(s, batch)
    print(json.dumps({"operator": op}))
"""


def _time(client: httpx.Client, url: str, key: str, query: str, variables: dict, n: int):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = client.post(
            f"{url}/graphql",
            json={"query": query, "variables": variables},
            headers={"Authorization": f"Bearer {key}"},
        )
        out.append((time.perf_counter() - t) * 1000)
        body = r.json()
        if r.status_code != 200 or body.get("errors"):
            raise RuntimeError(f"query failed: {r.status_code} {str(body)[:300]}")
    return out


def _statements(env: dict[str, str], key: str, query: str, variables: dict) -> int:
    """SQL statements the query runs, counted in-process on the scratch database (warm)."""
    code = r"""
import json, sys
from sqlalchemy import event
from fastapi.testclient import TestClient
from app.core.db import get_engine
from app.main import create_app
key, query, variables = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with TestClient(create_app()) as c:
    def go():
        r = c.post("/graphql", json={"query": query, "variables": variables},
                   headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and not r.json().get("errors"), r.text[:300]
    go()  # warm: the key's lookup is cached after its first use
    n = [0]
    def count(*_a, **_k):
        n[0] += 1
    event.listen(get_engine(), "before_cursor_execute", count)
    go()
    print(n[0])
"""
    out = subprocess.run(
        [sys.executable, "-c", code, key, query, json.dumps(variables)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


def run(workloads: int = 10_000, gpus: int = 10_000, requests: int = 300, warmup: int = 50):
    nodes_per_region = max(1, gpus // 16)  # two regions of 8-GPU nodes
    dep = ScratchDeployment(workers=0)
    try:
        key, _ = dep.seed(nodes_per_region)
        seeded = subprocess.run(
            [sys.executable, "-c", _SEED, str(workloads)],
            cwd=ROOT,
            env=dep.env,
            capture_output=True,
            text=True,
        )
        if seeded.returncode:
            raise RuntimeError(seeded.stderr[-2000:])
        # Statistics and visibility maps, as a live database has them once autovacuum has seen
        # the bulk insert (PostgreSQL 13+ vacuums after inserts too).
        import sqlalchemy as sa

        engine = sa.create_engine(dep.env["DATABASE_URL"], isolation_level="AUTOCOMMIT")
        with engine.connect() as c:
            c.execute(sa.text("VACUUM ANALYZE"))
        engine.dispose()
        op = json.loads(seeded.stdout.strip().splitlines()[-1])["operator"]
        url = dep.start(api_processes=1)
        results: list[dict[str, Any]] = []
        fleet_vars = {"first": 100}  # a page of 100 nodes: 800 GPUs with their holders
        with httpx.Client(timeout=30) as client:
            for name, k, query, variables in (
                ("dashboard", key, DASHBOARD, {}),
                ("fleet", op, FLEET, fleet_vars),
            ):
                # The first request: nothing kept yet (the month's bill is read in full).
                first = _time(client, url, k, query, variables, 1)[0]
                _time(client, url, k, query, variables, warmup)
                ms = _time(client, url, k, query, variables, requests)
                results.append(
                    {
                        "query": name,
                        "requests": requests,
                        "first_ms": round(first, 2),
                        "p50_ms": round(statistics.median(ms), 2),
                        "p99_ms": round(pct(ms, 0.99), 2),
                        "sql_statements": _statements(dep.env, k, query, variables),
                    }
                )
        # Statements do not grow with the page: the same queries at a tenth of the page.
        small = _statements(dep.env, key, DASHBOARD.replace("first: 50", "first: 5"), {})
        small_fleet = _statements(dep.env, op, FLEET, {"first": 10})
        return {
            "workloads": workloads,
            "gpus": nodes_per_region * 2 * 8,
            "queries": results,
            "sql_statements_small_pages": {"dashboard_5": small, "fleet_10": small_fleet},
            "targets": {
                "dashboard_p99_under_100ms": results[0]["p99_ms"] < 100,
                "fleet_p99_under_300ms": results[1]["p99_ms"] < 300,
                "statements_constant_in_page_size": small == results[0]["sql_statements"]
                and small_fleet == results[1]["sql_statements"],
            },
        }
    finally:
        dep.close()
