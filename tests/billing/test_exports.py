"""Finance exports: one row per day, tenant, SKU, tier, region, plan and price version; quantities
add up to the ledger exactly and amounts to the bill to the cent; CSV and JSON lines, from the
API (streamed) and the CLI; each tenant sees only its own rows."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from tests.fixtures.harness import ROOT
from tests.fixtures.world import auth

PERIOD = "2026-09"
T0 = datetime(2026, 9, 1, tzinfo=UTC)
CHANGE = datetime(2026, 9, 10, 12, 30, tzinfo=UTC)  # a price change in the middle of a day


def _usage(tenant, n: int, start: datetime, hours: float, **dims):
    alloc = uuid.uuid5(uuid.NAMESPACE_URL, f"{tenant.id}:{n}")
    base = {
        "allocation_id": str(alloc),
        "workload_id": str(alloc),
        "tenant_id": str(tenant.id),
        "region": dims.get("region", "r1"),
        "gpu_model": "H100-80GB",
        "shape": dims.get("shape", "whole"),
        "tier": dims.get("tier", "dedicated-gpu"),
        "priority": dims.get("priority", "training"),
        "gpu_milli": dims.get("milli", 1000),
    }
    stop = start + timedelta(hours=hours)
    return [
        {**base, "event_key": f"x{alloc}:start", "kind": "start", "occurred_at": start.isoformat()},
        {**base, "event_key": f"x{alloc}:stop", "kind": "stop", "occurred_at": stop.isoformat()},
    ]


@pytest.fixture
def month(client, world):
    op = world.key(None)
    a, b = world.tenant("exp-a"), world.tenant("exp-b")
    for cents, since, plan in (
        (333, T0, "on_demand"),
        (357, CHANGE, "on_demand"),
        (97, T0, "preemptible"),
    ):
        r = client.post(
            "/v1/admin/prices",
            json={
                "gpu_model": "H100-80GB",
                "shape": "whole",
                "plan": plan,
                "currency": "usd",
                "unit_amount": cents,
                "effective_from": since.isoformat(),
            },
            headers=auth(op),
        )
        assert r.status_code == 201, r.text
    events = (
        # 7 GPUs for 50 hours from the 9th, across days and the price change
        _usage(a, 1, datetime(2026, 9, 9, 7, 13, 11, 5, tzinfo=UTC), 50.3, milli=7000)
        + _usage(a, 2, datetime(2026, 9, 3, 23, 59, tzinfo=UTC), 0.5, priority="preemptible")
        + _usage(a, 3, datetime(2026, 9, 30, 20, tzinfo=UTC), 10, region="r2")  # into October
        + _usage(a, 4, datetime(2026, 9, 5, tzinfo=UTC), 2, shape="mig-1g", milli=142)  # unpriced
        + _usage(b, 1, datetime(2026, 9, 20, 1, tzinfo=UTC), 3.7, milli=3000)
    )
    events.append(
        {
            **{k: v for k, v in events[0].items() if k not in ("event_key", "kind")},
            "event_key": "credit-1",
            "kind": "adjustment",
            "quantity": -123_456_789,
            "occurred_at": datetime(2026, 9, 11, 3, tzinfo=UTC).isoformat(),
        }
    )
    r = client.post("/v1/admin/usage/events", json={"events": events}, headers=auth(op))
    assert r.status_code == 200, r.text
    return {"op": op, "a": a, "b": b}


def _ledger(client, key, tenant_id=None) -> int:
    params = {"from": T0.isoformat(), "to": datetime(2026, 10, 1, tzinfo=UTC).isoformat()}
    path = "/v1/usage"
    if tenant_id is not None:
        path, params = "/v1/admin/usage", {**params, "tenant_id": str(tenant_id)}
    rows = client.get(path, params=params, headers=auth(key)).json()["rows"]
    return sum(r["milli_gpu_ms"] for r in rows)


def test_rows_add_up_to_the_ledger_and_the_bill_exactly(client, world, month):
    r = client.get(
        "/v1/admin/billing/exports",
        params={"period": PERIOD, "format": "csv"},
        headers=auth(month["op"]),
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    assert "rackplane-usage-2026-09.csv" in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert int(r.headers["x-row-count"]) == len(rows)
    keys = [
        (x["day"], x["tenant_id"], x["sku"], x["tier"], x["region"], x["plan"], x["price_version"])
        for x in rows
    ]
    assert len(keys) == len(set(keys))  # one row per day, tenant, SKU, tier, region, plan, version
    a, b = str(month["a"].id), str(month["b"].id)
    for t in (a, b):
        mine = [x for x in rows if x["tenant_id"] == t]
        assert sum(int(x["quantity_milli_gpu_ms"]) for x in mine) == _ledger(client, month["op"], t)
        bill = client.get(
            "/v1/billing/summary",
            params={"period": PERIOD},
            headers=auth(world.key(month[t == a and "a" or "b"])),
        ).json()
        assert sum(int(x["amount"] or 0) for x in mine) == bill["totals"]["usd"]
    # The 10th is split at the price change: version 1 before 12:30, version 2 after.
    tenth = {
        x["price_version"]: x
        for x in rows
        if x["day"] == "2026-09-10" and x["plan"] == "on_demand" and x["tenant_id"] == a
    }
    assert set(tenth) == {"1", "2"}
    assert int(tenth["1"]["quantity_milli_gpu_ms"]) == 7000 * int(12.5 * 3_600_000)
    assert (tenth["1"]["unit_amount"], tenth["2"]["unit_amount"]) == ("333", "357")
    # Unpriced usage is exported with its quantity and no price, not dropped.
    mig = [x for x in rows if x["shape"] == "mig-1g"]
    assert mig and all(x["price_version"] == "" and x["amount"] == "0" for x in mig)
    # October's share of the last allocation is not in September.
    assert max(x["day"] for x in rows) == "2026-09-30"


def test_tenants_export_only_their_own_and_jsonl_matches_csv(client, world, month):
    a_key = world.key(month["a"])
    r = client.get(
        "/v1/billing/exports", params={"period": PERIOD, "format": "jsonl"}, headers=auth(a_key)
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert rows and {x["tenant_id"] for x in rows} == {str(month["a"].id)}
    assert sum(x["quantity_milli_gpu_ms"] for x in rows) == _ledger(client, a_key)
    as_csv = client.get("/v1/billing/exports", params={"period": PERIOD}, headers=auth(a_key)).text
    assert len(list(csv.DictReader(io.StringIO(as_csv)))) == len(rows)
    b_rows = client.get(
        "/v1/billing/exports",
        params={"period": PERIOD, "format": "jsonl"},
        headers=auth(world.key(month["b"])),
    ).text
    assert str(month["a"].id) not in b_rows


@pytest.mark.parametrize(
    "params,code",
    [
        ({"period": "2026-13"}, "validation_error"),
        ({"period": "last month"}, "validation_error"),
        ({"period": PERIOD, "format": "xlsx"}, None),
        ({}, None),
    ],
)
def test_bad_export_requests_are_422_problems(client, world, params, code):
    r = client.get("/v1/admin/billing/exports", params=params, headers=auth(world.key(None)))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    if code:
        assert r.json()["code"] == code


def test_the_cli_writes_the_same_rows_as_the_api(client, world, month, tmp_path):
    out = tmp_path / "sept.csv"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "billing",
            "export",
            "--period",
            PERIOD,
            "--format",
            "csv",
            "-o",
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    api = client.get(
        "/v1/admin/billing/exports", params={"period": PERIOD}, headers=auth(month["op"])
    ).text
    assert out.read_text() == api
    bad = subprocess.run(
        [sys.executable, "-m", "app.cli", "billing", "export", "--period", "2026-13"],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "period" in bad.stderr
