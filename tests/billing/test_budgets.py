"""Budgets on PostgreSQL and a real worker: alerts at 50/80/100 % written once, submissions
refused with a clear problem at the hard limit, preemptible work stopped when the tenant chose
so, and limits raised take effect at once."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from tests.fixtures.workloads import ALL, fleet, running
from tests.fixtures.world import auth, wait_until


def _month_start() -> datetime:
    now = datetime.now(UTC)
    return datetime(now.year, now.month, 1, tzinfo=UTC)


def _price(client, op, cents=300, plan="on_demand"):
    r = client.post(
        "/v1/admin/prices",
        json={
            "gpu_model": "H100-80GB",
            "shape": "whole",
            "plan": plan,
            "currency": "usd",
            "unit_amount": cents,
            "effective_from": (_month_start() - timedelta(days=40)).isoformat(),
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text


def _gpu_hour(client, op, tenant, n: int):
    """One GPU-hour of usage for `tenant` (60 GPUs for a minute), early this month."""
    alloc = uuid.uuid4()
    start = _month_start() + timedelta(minutes=2 * n)
    base = {
        "allocation_id": str(alloc),
        "workload_id": str(alloc),
        "tenant_id": str(tenant.id),
        "region": "r1",
        "gpu_model": "H100-80GB",
        "shape": "whole",
        "tier": "dedicated-gpu",
        "priority": "training",
        "gpu_milli": 60_000,
    }
    events = [
        {**base, "event_key": f"b{alloc}:start", "kind": "start", "occurred_at": start.isoformat()},
        {
            **base,
            "event_key": f"b{alloc}:stop",
            "kind": "stop",
            "occurred_at": (start + timedelta(minutes=1)).isoformat(),
        },
    ]
    r = client.post("/v1/admin/usage/events", json={"events": events}, headers=auth(op))
    assert r.status_code == 200, r.text


def test_alerts_once_per_threshold_then_refusal_at_the_limit_until_raised(client, world):
    from app.billing import budgets
    from app.core.db import session_scope

    op = world.key(None)
    world.fleet(fleet(1))
    t = world.tenant("budget", policy=ALL)
    key = world.key(t)
    _price(client, op)
    _gpu_hour(client, op, t, 0)  # 300 cents

    r = client.put("/v1/budget", json={"spend_limit": 500}, headers=auth(key))
    assert r.status_code == 200, r.text
    b = r.json()
    assert (b["spent"], b["exhausted"], b["currency"]) == (300, False, "usd")
    assert [(a["metric"], a["threshold_pct"]) for a in b["alerts"]] == [("spend", 50)]

    _gpu_hour(client, op, t, 1)  # 600 of 500
    with session_scope() as s:
        new = budgets.evaluate(s)
    assert sorted(a["threshold_pct"] for a in new) == [80, 100]
    with session_scope() as s:
        assert budgets.evaluate(s) == []  # each threshold alerts once a month
    b = client.get("/v1/budget", headers=auth(key)).json()
    assert b["exhausted"] and b["spent"] == 600
    assert [a["threshold_pct"] for a in b["alerts"]] == [50, 80, 100]

    r = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
    assert r.status_code == 402, r.text
    problem = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert problem["code"] == "budget_exhausted" and problem["spent"] == 600
    assert problem["spend_limit"] == 500
    # Said in the currency, with what to change.
    assert "($6.00 spent of $5.00)" in problem["detail"] and "PUT /v1/budget" in problem["detail"]

    # Raising the limit lifts the refusal at once; a GPU-hour limit alerts on its own.
    r = client.put("/v1/budget", json={"spend_limit": 1000, "gpu_hour_limit": 3}, headers=auth(key))
    b = r.json()
    assert not b["exhausted"] and b["gpu_hours_used"] == 2.0
    assert ("gpu_hours", 50) in {(a["metric"], a["threshold_pct"]) for a in b["alerts"]}
    r = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key))
    assert r.status_code == 201, r.text

    # Budgets are each tenant's own: another tenant has none, and cannot reach this one.
    other = world.key(world.tenant("other"))
    assert client.get("/v1/budget", headers=auth(other)).status_code == 404
    admin = client.get(f"/v1/admin/tenants/{t.id}/budget", headers=auth(op)).json()
    assert admin["spent"] == 600
    assert client.get(f"/v1/admin/tenants/{t.id}/budget", headers=auth(other)).status_code == 403
    assert client.delete("/v1/budget", headers=auth(key)).status_code == 204
    assert client.get("/v1/budget", headers=auth(key)).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"spend_limit": -1},
        {"spend_limit": 10, "currency": "US"},
        {"gpu_hour_limit": 1.5},
        {"spend_limit": 10, "surprise": True},
    ],
)
def test_bad_budgets_are_422_problems_and_nothing_is_written(client, world, body):
    key = world.key(world.tenant("bad-budget"))
    r = client.put("/v1/budget", json=body, headers=auth(key))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert client.get("/v1/budget", headers=auth(key)).status_code == 404


def test_the_worker_stops_preemptible_work_at_the_limit_when_asked(
    client, world, celery_worker_process
):
    op = world.key(None)
    world.fleet(fleet(1))
    t = world.tenant("stopper", policy=ALL)
    key = world.key(t)
    _price(client, op)
    _price(client, op, cents=100, plan="preemptible")
    spot = client.post(
        "/v1/workloads",
        json={"kind": "instance", "gpus": 1, "priority": "preemptible"},
        headers=auth(key),
    ).json()["id"]
    prod = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key)
    ).json()["id"]
    running(client, key, spot)
    running(client, key, prod)

    r = client.put(
        "/v1/budget", json={"spend_limit": 200, "stop_preemptible": True}, headers=auth(key)
    )
    assert r.status_code == 200 and not r.json()["exhausted"]
    # Usage beyond the limit: the worker's evaluator (beat) marks the month exhausted, stops
    # the preemptible workload and leaves the other one running.
    _gpu_hour(client, op, t, 0)
    wait_until(
        lambda: (
            client.get(f"/v1/workloads/{spot}", headers=auth(key)).json()["state"] == "terminated"
        ),
        timeout=30,
    )
    events = client.get(f"/v1/workloads/{spot}/events", headers=auth(key)).json()["items"]
    assert "budget" in events[-1]["reason"]
    assert client.get(f"/v1/workloads/{prod}", headers=auth(key)).json()["state"] == "running"


def test_an_unused_commitment_is_spend_but_not_gpu_hours(client, world):
    op = world.key(None)
    t = world.tenant("committed-budget")
    key = world.key(t)
    _price(client, op, cents=200, plan="reserved")
    start = _month_start()
    r = client.post(
        f"/v1/admin/tenants/{t.id}/commitments",
        json={
            "gpu_model": "H100-80GB",
            "gpus": 1,
            "starts_at": start.isoformat(),
            "ends_at": (start + timedelta(hours=2)).isoformat(),
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    _gpu_hour(client, op, t, 0)  # 60 GPUs for one minute: 1 reserved GPU-minute, rest on demand
    r = client.put(
        "/v1/budget", json={"spend_limit": 10**6, "gpu_hour_limit": 10}, headers=auth(key)
    )
    assert r.status_code == 200, r.text
    # Evaluated once the term is over (an unused commitment is owed only as its time passes).
    from app.billing import budgets
    from app.core.db import session_scope
    from app.models.billing import Budget

    with session_scope() as s:
        budgets.evaluate(s, now=max(datetime.now(UTC), start + timedelta(hours=3)))
    with session_scope() as s:
        b = s.get(Budget, t.id)
        assert b.used_milli_gpu_ms == 1000 * 3_600_000  # the usage, not the idle commitment
        # Two committed GPU-hours at 200 are owed in full (one GPU-minute of them used); the
        # other 59 GPU-minutes are on demand, and no on-demand price exists.
        assert b.spent == 400


def test_money_is_said_in_its_currency():
    from app.core.money import format_money

    assert format_money(3813784, "usd") == "$38,137.84"
    assert format_money(500000, "usd") == "$5,000.00"
    assert format_money(-1250, "eur") == "-€12.50"
    assert format_money(1500, "jpy") == "¥1,500"
    assert format_money(123450, "chf") == "1,234.50 CHF"


def test_a_dry_run_prices_its_placement_and_the_budget_it_would_leave(client, world):
    """Issue 45 item 15: a price before submitting, the same through REST and GraphQL."""
    world.fleet(fleet(1))
    op = world.key()
    key = world.key(world.tenant("acme", policy=ALL))
    body = {"kind": "job", "gpus": 4, "replicas": 2, "max_runtime_s": 7200}
    unpriced = client.post("/v1/workloads:dry-run", json=body, headers=auth(key)).json()
    assert unpriced["price"]["currency"] is None and unpriced["price"]["unpriced_replicas"] == 2
    _price(client, op, cents=300)
    got = client.post("/v1/workloads:dry-run", json=body, headers=auth(key)).json()
    # 8 GPUs at $3.00 an hour; two hours at most.
    assert got["price"] == {
        "currency": "usd",
        "plan": "on_demand",
        "per_hour": 2400,
        "max_cost": 4800,
        "unpriced_replicas": 0,
        "budget_left": None,
        "budget_hours": None,
    }, got
    assert client.put("/v1/budget", json={"spend_limit": 10_000}, headers=auth(key)).status_code
    got = client.post("/v1/workloads:dry-run", json=body, headers=auth(key)).json()
    assert (got["price"]["budget_left"], got["price"]["budget_hours"]) == (5200, 4.17), got
    q = "query($i: WorkloadInput!) { dryRun(input: $i) { price { perHour maxCost budgetLeft } } }"
    data = client.post(
        "/graphql",
        json={"query": q, "variables": {"i": {"kind": "job", "gpus": 4, "replicas": 2,
                                               "maxRuntimeS": 7200}}},
        headers=auth(key),
    ).json()  # fmt: skip
    assert data["data"]["dryRun"]["price"] == {"perHour": 2400, "maxCost": 4800, "budgetLeft": 5200}
