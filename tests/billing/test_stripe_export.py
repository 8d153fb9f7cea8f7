"""Usage to Stripe meter events through the outbox, against the local stand-in (rackplane_bench/
stripe_standin.py): customers created once, every closed bucket sent once with its deterministic
identifier, corrections cancelled and re-sent within 24 hours and credited after, 429s backed
off, one call at a time per customer and meter, the exporter killed between Stripe's answer and
the outbox update many times, and reconciliation at zero throughout."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from rackplane_bench.stripe_standin import StandIn, serve
from tests.fixtures.harness import ROOT
from tests.fixtures.world import auth, wait_until

HOUR = timedelta(hours=1)


@pytest.fixture(scope="session")
def standin():
    state = StandIn()
    server, url = serve(state)
    yield state, url
    server.shutdown()


@pytest.fixture
def stripe_on(standin, monkeypatch):
    from app.core.config import get_settings

    state, url = standin
    state.reset()
    monkeypatch.setenv("RACKPLANE_STRIPE_API_KEY", "sk_test_rackplane")
    monkeypatch.setenv("RACKPLANE_STRIPE_API_BASE", url)
    get_settings.cache_clear()
    yield state
    get_settings.cache_clear()


def _customer(world, slug: str):
    """A tenant and its Stripe customer (the onboarding task, called here in-process)."""
    from app.billing.tasks import ensure_customer

    t = world.tenant(slug)
    t.stripe_customer_id = ensure_customer(str(t.id))
    return t


def _alloc(tenant, start, stop, *, milli=1000, shape="whole", priority="training", region="r1"):
    alloc = uuid.uuid4()
    base = {
        "allocation_id": str(alloc),
        "workload_id": str(alloc),
        "tenant_id": str(tenant.id),
        "region": region,
        "gpu_model": "H100-80GB",
        "shape": shape,
        "tier": "dedicated-gpu",
        "priority": priority,
        "gpu_milli": milli,
    }
    out = [{**base, "event_key": f"{alloc}:start", "kind": "start", "occurred_at": start}]
    if stop is not None:
        out.append({**base, "event_key": f"{alloc}:stop", "kind": "stop", "occurred_at": stop})
    return out


def _adjust(tenant, at, quantity, *, shape="whole", priority="training"):
    return {
        "event_key": f"adj:{uuid.uuid4()}",
        "kind": "adjustment",
        "tenant_id": str(tenant.id),
        "region": "r1",
        "gpu_model": "H100-80GB",
        "shape": shape,
        "tier": "dedicated-gpu",
        "priority": priority,
        "gpu_milli": 0,
        "quantity": quantity,
        "occurred_at": at,
        "reason": "correction",
    }


def _ingest(events):
    from app.core.db import session_scope
    from app.metering.service import ingest

    with session_scope() as s:
        ingest(s, events)


def _push():
    from app.billing import stripe_export
    from app.core.db import session_scope

    with session_scope() as s:
        planned = stripe_export.plan(s)
    return planned, stripe_export.send()


def _periods(*times: datetime) -> set[str]:
    return {f"{t:%Y-%m}" for t in times}


def _reconciled(periods) -> dict[tuple[str, str], int]:
    """Ledger totals per (customer, meter) after checking every row has no difference."""
    from app.billing import stripe_export
    from app.core.db import session_scope
    from app.tenancy.principal import SYSTEM

    totals: Counter = Counter()
    with session_scope() as s:
        for p in periods:
            rep = stripe_export.reconcile(s, SYSTEM, p)
            assert rep["differences"] == 0, rep
            for r in rep["rows"]:
                assert r["pending_events"] == 0 and r["failed_events"] == 0, r
                totals[(r["stripe_customer_id"], r["meter"])] += (
                    r["exported_milli_gpu_ms"] + r["adjusted_milli_gpu_ms"]
                )
                assert r["ledger_milli_gpu_ms"] == (
                    r["exported_milli_gpu_ms"] + r["adjusted_milli_gpu_ms"]
                )
    return {k: v for k, v in totals.items() if v}


def test_customers_are_created_once_with_the_pinned_api_version(stripe_on, world, session):
    from app.billing.stripe_gateway import API_VERSION
    from app.billing.tasks import ensure_customer
    from app.models.tenants import Tenant

    t = _customer(world, "cust")
    assert t.stripe_customer_id.startswith("cus_")
    assert ensure_customer(str(t.id)) == t.stripe_customer_id  # kept: no second call
    # Lost after Stripe answered (the id never stored): the idempotency key returns the same
    # customer rather than a second one.
    session.execute(update(Tenant).where(Tenant.id == t.id).values(stripe_customer_id=None))
    session.commit()
    assert ensure_customer(str(t.id)) == t.stripe_customer_id
    assert len(stripe_on.customers) == 1
    calls = stripe_on.accepted("/v1/customers")
    assert len(calls) == 2 and {c["version"] for c in calls} == {API_VERSION}
    assert calls[0]["body"]["metadata"] == {"rackplane_tenant_id": str(t.id)}


def test_closed_buckets_go_once_and_corrections_cancel_resend_or_credit(
    stripe_on, world, client, session
):
    from app.models.billing import BillingAdjustment, MeterExport

    a, b = _customer(world, "meter-a"), _customer(world, "meter-b")
    h = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 6 * HOUR
    iso = datetime.isoformat
    _ingest(
        _alloc(
            a, iso(h + timedelta(minutes=10)), iso(h + 2 * HOUR + timedelta(minutes=30)), milli=8000
        )
        + _alloc(a, iso(h), iso(h + timedelta(minutes=30)), priority="preemptible")
        + _alloc(b, iso(h + HOUR), iso(h + 2 * HOUR), milli=142, shape="mig-1g")
    )
    stripe_on.rate_limit_next = 3  # backed off and retried, not lost
    planned, sent = _push()
    assert planned.events == 5 and sent.sent == 5  # 3 hours + 1 + 1
    events = stripe_on.accepted("/v1/billing/meter_events")
    assert len(events) == 5
    assert sum(1 for c in stripe_on.calls if c["status"] == 429) == 3
    for c in events:
        assert len(c["body"]["identifier"]) <= 100
        assert int(c["body"]["timestamp"]) % 3600 == 0  # the bucket's start
    meters = {e.event_name for e in stripe_on.events.values()}
    assert meters == {
        "gpu_h100_80gb_whole_on_demand",
        "gpu_h100_80gb_whole_preemptible",
        "gpu_h100_80gb_mig_1g_on_demand",
    }
    assert stripe_on.totals() == _reconciled(_periods(h, h + 3 * HOUR))
    assert stripe_on.totals()[(a.stripe_customer_id, "gpu_h100_80gb_whole_on_demand")] == (
        8000 * 140 * 60_000
    )

    # Nothing new: planning again sends nothing.
    planned, sent = _push()
    assert (planned.events, planned.cancels, sent.sent) == (0, 0, 0)

    # Late, within 24 hours: more usage for B (a new event for the difference), less for A in
    # its second hour (the hour's event is cancelled, then the right total sent again).
    _ingest(
        _alloc(b, iso(h + HOUR + timedelta(minutes=5)), iso(h + HOUR + timedelta(minutes=6)))
        + [_adjust(a, iso(h + HOUR + timedelta(minutes=1)), -1_000_000)]
    )
    planned, sent = _push()
    assert (planned.events, planned.cancels, sent.cancelled) == (1, 1, 1)
    planned, sent = _push()
    assert (planned.events, sent.sent) == (1, 1)
    assert len(stripe_on.accepted("/v1/billing/meter_event_adjustments")) == 1
    assert stripe_on.totals() == _reconciled(_periods(h, h + 3 * HOUR))

    # Later than Stripe's 24-hour cancel window: a credit adjustment in our ledger instead.
    session.execute(update(MeterExport).values(sent_at=datetime.now(UTC) - 25 * HOUR))
    session.commit()
    _ingest([_adjust(a, iso(h + 2 * HOUR), -2_000_000)])
    planned, sent = _push()
    assert (planned.events, planned.cancels, planned.adjustments) == (0, 0, 1)
    credit = session.scalar(select(BillingAdjustment))
    assert credit.quantity == -2_000_000 and credit.tenant_id == a.id
    totals = _reconciled(_periods(h, h + 3 * HOUR))
    key = (a.stripe_customer_id, "gpu_h100_80gb_whole_on_demand")
    assert totals[key] == stripe_on.totals()[key] - 2_000_000

    # The report over the API, for operators only.
    op = world.key(None)
    for p in _periods(h, h + 3 * HOUR):
        r = client.get("/v1/admin/billing/reconciliation", params={"period": p}, headers=auth(op))
        assert r.status_code == 200 and r.json()["differences"] == 0, r.text
    tenant_key = world.key(a)
    r = client.get(
        "/v1/admin/billing/reconciliation",
        params={"period": f"{h:%Y-%m}"},
        headers=auth(tenant_key),
    )
    assert r.status_code == 403


def _push_process(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "billing", "push"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _many_hours(world, tenants: int, hours: int):
    ts = [_customer(world, f"kill-{i}") for i in range(tenants)]
    h = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - (hours + 1) * HOUR
    events = []
    for i, t in enumerate(ts):
        events += _alloc(
            t,
            (h + timedelta(minutes=7 * i)).isoformat(),
            (h + hours * HOUR).isoformat(),
            milli=1000 * (i + 1),
        )
    _ingest(events)
    return ts, h


def test_the_exporter_killed_between_stripe_and_the_outbox_loses_and_doubles_nothing(
    stripe_on, world, standin
):
    from app.core.db import session_scope
    from app.models.billing import MeterExport

    ts, h = _many_hours(world, tenants=3, hours=6)  # 18 meter events
    env = {
        **os.environ,
        "RACKPLANE_STRIPE_API_KEY": "sk_test_rackplane",
        "RACKPLANE_STRIPE_API_BASE": standin[1],
    }
    rng = random.Random(7)
    crashes = 0
    for _ in range(60):
        run = _push_process(
            {**env, "RACKPLANE_FAULT_EXIT_AFTER_STRIPE_CALLS": str(rng.randint(1, 3))}
        )
        if run.returncode == 0:
            break
        assert run.returncode == 75, run.stderr[-2000:]
        crashes += 1
    final = _push_process(env)
    assert final.returncode == 0, final.stderr[-2000:]
    assert crashes >= 5

    with session_scope() as s:
        rows = list(s.scalars(select(MeterExport)))
    assert len(rows) == 18 and all(r.state == "sent" for r in rows)
    # Every identifier reached Stripe's books once; the re-sends after each crash were refused
    # as duplicates, not counted twice.
    accepted = Counter(
        c["body"]["identifier"] for c in stripe_on.accepted("/v1/billing/meter_events")
    )
    assert set(accepted) == {r.identifier for r in rows}
    assert set(accepted.values()) == {1}
    assert stripe_on.duplicates >= crashes - 1
    assert stripe_on.totals() == _reconciled(_periods(h, h + 7 * HOUR))


def test_two_exporters_at_once_make_one_call_at_a_time_per_customer_and_meter(
    stripe_on, world, standin
):
    ts, h = _many_hours(world, tenants=2, hours=5)
    stripe_on.delay = 0.05
    env = {
        **os.environ,
        "RACKPLANE_STRIPE_API_KEY": "sk_test_rackplane",
        "RACKPLANE_STRIPE_API_BASE": standin[1],
    }
    # Plan first, so both processes find the same rows to send.
    from app.billing import stripe_export
    from app.core.db import session_scope

    with session_scope() as s:
        assert stripe_export.plan(s).events == 10
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "app.cli", "billing", "push"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    _push()  # whatever a skipped lock left behind
    assert stripe_on.concurrency_violations == 0
    assert len(stripe_on.events) == 10
    assert stripe_on.totals() == _reconciled(_periods(h, h + 6 * HOUR))


def test_a_workload_is_metered_priced_exported_sent_and_reconciled_end_to_end(standin):
    """What a new user does: run a workload, see usage and cost accrue, export the month, and
    find the same totals in Stripe and in the reconciliation report; a real API and worker
    (with beat) on a scratch database, with one-second buckets so it finishes in a test."""
    import json

    import httpx

    from rackplane_bench.deploy import ScratchDeployment

    state, url = standin
    state.reset()
    dep = ScratchDeployment(
        workers=1,
        env={
            "RACKPLANE_STRIPE_API_KEY": "sk_test_rackplane",
            "RACKPLANE_STRIPE_API_BASE": url,
            "RACKPLANE_METER_BUCKET": "1",
            "RACKPLANE_METER_SETTLE": "1",
            "RACKPLANE_METER_EXPORT_EVERY": "1",
        },
    )
    try:
        key, _ = dep.seed(nodes_per_region=1)
        api = dep.start()
        c = httpx.Client(base_url=api, timeout=30)
        h = {"Authorization": f"Bearer {key}"}
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", "keys", "create", "--platform", "--name", "op"],
            cwd=ROOT,
            env=dep.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        op = {"Authorization": f"Bearer {out.split()[-1]}"}
        price = {
            "gpu_model": "H100-80GB",
            "shape": "whole",
            "plan": "on_demand",
            "currency": "usd",
            "unit_amount": 360_000,  # $3,600 a GPU-hour: a cent a GPU-second
            "effective_from": "2026-01-01T00:00:00Z",
        }
        assert c.post("/v1/admin/prices", json=price, headers=op).status_code == 201
        # Onboarding created the Stripe customer (a task, after commit).
        customer = wait_until(lambda: c.get("/v1/tenant", headers=h).json()["stripe_customer_id"])

        body = {"kind": "instance", "gpus": 2, "gpu_models": ["H100-80GB"]}
        wid = c.post("/v1/workloads", json=body, headers=h).json()["id"]
        _running_at(c, h, wid)
        time.sleep(3)
        upcoming = c.get("/v1/billing/upcoming", headers=h).json()
        assert upcoming["totals"]["usd"] >= 2 * 300  # two GPUs, three seconds or more
        period = upcoming["period"]
        assert c.delete(f"/v1/workloads/{wid}", headers=h).status_code == 200
        stopped = datetime.now(UTC) + timedelta(seconds=1)

        def settled():
            rep = c.get(
                "/v1/admin/billing/reconciliation", params={"period": period}, headers=op
            ).json()
            through = datetime.fromisoformat(rep["through"])
            pending = sum(r["pending_events"] for r in rep["rows"])
            return rep if rep["rows"] and through > stopped and not pending else None

        rep = wait_until(settled, timeout=60)
        assert rep["differences"] == 0, rep
        (row,) = rep["rows"]
        ledger = row["ledger_milli_gpu_ms"]
        assert row["stripe_customer_id"] == customer and ledger >= 2 * 1000 * 3000
        assert state.totals() == {(customer, row["meter"]): ledger}

        usage = c.get(
            "/v1/usage",
            params={
                "from": f"{period}-01T00:00:00Z",
                "to": (datetime.now(UTC) + timedelta(days=1)).isoformat(),
                "granularity": "day",
            },
            headers=h,
        ).json()
        assert sum(u["milli_gpu_ms"] for u in usage["rows"]) == ledger
        export = c.get(
            "/v1/admin/billing/exports",
            params={"period": period, "format": "jsonl"},
            headers=op,
        )
        assert export.status_code == 200
        rows = [json.loads(x) for x in export.text.splitlines()]
        bill = c.get("/v1/billing/summary", params={"period": period}, headers=h).json()
        assert sum(r["quantity_milli_gpu_ms"] for r in rows) == ledger
        assert sum(r["amount"] for r in rows) == bill["totals"]["usd"] > 0
    finally:
        dep.close()


def _running_at(c, h, wid):
    wait_until(lambda: c.get(f"/v1/workloads/{wid}", headers=h).json()["state"] == "running")


@pytest.mark.parametrize("bucket_seconds", [3600, 900])
def test_meters_split_committed_usage_exactly_as_the_bill_does(
    stripe_on, world, client, monkeypatch, bucket_seconds
):
    from app.billing import commitments
    from app.core.config import get_settings
    from app.core.db import session_scope

    monkeypatch.setenv("RACKPLANE_METER_BUCKET", str(bucket_seconds))
    get_settings.cache_clear()
    a = _customer(world, f"reserved-{bucket_seconds}")
    h = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 8 * HOUR
    with session_scope() as s:
        commitments.create(
            s, a.id, gpu_model="H100-80GB", region="*", gpus_milli=3000,
            starts_at=h, ends_at=h + 4 * HOUR,
        )  # fmt: skip
    iso = datetime.isoformat
    # Bursty within hours (so a bucket shorter than an hour must not split it differently), one
    # run past the term's end, and preemptible work that never draws on the commitment.
    _ingest(
        _alloc(a, iso(h), iso(h + timedelta(minutes=20)), milli=5000)
        + _alloc(a, iso(h + timedelta(minutes=40)), iso(h + 5 * HOUR), milli=2000)
        + _alloc(a, iso(h + timedelta(minutes=50)), iso(h + 2 * HOUR), milli=1000, region="r2")
        + _alloc(a, iso(h), iso(h + 3 * HOUR), priority="preemptible")
        + _alloc(
            a, iso(h + HOUR), iso(h + HOUR + timedelta(minutes=25)), milli=3000, shape="mig-1g"
        )
    )
    # One run part-way through an hour, then the rest.
    from app.billing import stripe_export

    with session_scope() as s:
        stripe_export.plan(s, now=h + HOUR + timedelta(minutes=50))
    stripe_export.send()
    _push()
    bill = client.get(
        "/v1/billing/summary", params={"period": f"{h:%Y-%m}"}, headers=auth(world.key(a))
    ).json()
    if f"{h:%Y-%m}" != f"{h + 5 * HOUR:%Y-%m}":
        pytest.skip("the window straddles a month end")
    from app.billing.stripe_export import meter_name

    billed: Counter = Counter()
    for ln in bill["lines"]:
        if ln["shape"] != commitments.UNUSED:
            billed[
                (a.stripe_customer_id, meter_name(ln["gpu_model"], ln["shape"], ln["plan"]))
            ] += ln["milli_gpu_ms"]
    sent = stripe_on.totals()
    assert sent == _reconciled(_periods(h, h + 5 * HOUR)) == dict(billed)
    assert {m for _, m in sent} == {
        "gpu_h100_80gb_whole_reserved",
        "gpu_h100_80gb_whole_on_demand",
        "gpu_h100_80gb_whole_preemptible",
        "gpu_h100_80gb_mig_1g_reserved",  # draws first: shapes draw in name order
    }
    assert sent[(a.stripe_customer_id, "gpu_h100_80gb_whole_preemptible")] == 3000 * 3_600_000


def test_what_the_late_row_search_cannot_see_the_next_full_pass_sends(stripe_on, world, session):
    """Three ways a past bucket changes without a freshly recorded ledger row: a row whose
    transaction committed long after it was stamped, a customer created after its usage, and a
    commitment recorded over a term already begun. Each reaches Stripe at the next full pass
    (on a timer, or asked for), and reconciliation ends at zero."""
    from app.billing import commitments
    from app.billing.tasks import ensure_customer
    from app.core.db import session_scope
    from app.models.billing import MeterExportCursor

    a = _customer(world, "late-a")
    b = world.tenant("late-b")  # no Stripe customer yet
    h = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 6 * HOUR
    iso = datetime.isoformat
    long_ago = datetime.now(UTC) - HOUR  # recorded well before any run looks for late rows
    early = _alloc(a, iso(h), iso(h + HOUR)) + _alloc(b, iso(h), iso(h + 2 * HOUR), milli=2000)
    _ingest([{**e, "recorded_at": long_ago} for e in early])
    planned, sent = _push()  # the first run is a full pass
    assert sent.sent == 1 and set(stripe_on.customers) == {a.stripe_customer_id}

    # Stamped an hour ago, committed only now: the incremental run looks back 5 minutes.
    late = _alloc(a, iso(h + 2 * HOUR), iso(h + 3 * HOUR))
    _ingest([{**e, "recorded_at": long_ago} for e in late])
    planned, sent = _push()
    assert (planned.events, sent.sent) == (0, 0), planned
    with session_scope() as s:
        from app.billing import stripe_export
        from app.tenancy.principal import SYSTEM

        assert stripe_export.reconcile(s, SYSTEM, f"{h:%Y-%m}")["differences"] == 1
    session.execute(update(MeterExportCursor).values(full_pass_at=h))  # the timer is due
    session.commit()
    planned, sent = _push()
    assert (planned.events, sent.sent) == (1, 1)

    # B becomes a Stripe customer: onboarding asks for a full pass, which sends its past usage.
    b.stripe_customer_id = ensure_customer(str(b.id))
    planned, sent = _push()
    assert (planned.events, sent.sent) == (2, 2)  # its two hours

    # A commitment over A's past hours: what was sent for them is cancelled and sent again split.
    with session_scope() as s:
        commitments.create(
            s, a.id, gpu_model="H100-80GB", region="*", gpus_milli=1000,
            starts_at=h, ends_at=h + 24 * HOUR,
        )  # fmt: skip
    planned, sent = _push()  # on-demand hours cancelled, the same hours sent as reserved
    assert (planned.cancels, sent.cancelled, planned.events, sent.sent) == (2, 2, 2, 2)
    planned, sent = _push()
    assert (planned.events, planned.cancels) == (0, 0)
    totals = _reconciled(_periods(h, h + 3 * HOUR))
    assert stripe_on.totals() == totals
    assert totals == {
        (a.stripe_customer_id, "gpu_h100_80gb_whole_reserved"): 2 * 1000 * 3_600_000,
        (b.stripe_customer_id, "gpu_h100_80gb_whole_on_demand"): 2 * 2000 * 3_600_000,
    }
