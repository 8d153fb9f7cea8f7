"""Prices and bills: the most specific price version in effect prices each hour of usage, lines
split where a price changes, amounts are integers rounded once per line, and each tenant sees
only its own bill."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from app.billing.service import PriceBook, amount
from app.metering.service import GPU_HOUR, to_ms
from app.models.billing import Plan, Price
from tests.fixtures.billing import post, usage_event
from tests.fixtures.world import auth

T0 = datetime(2026, 10, 1, tzinfo=UTC)


def _price(shape="whole", tier="*", region="*", plan="on_demand", cents=250, since=T0, v=1):
    return Price(
        id=uuid.uuid4(),
        gpu_model="H100-80GB",
        shape=shape,
        tier=tier,
        region=region,
        plan=plan,
        currency="usd",
        unit_amount=cents,
        version=v,
        effective_from=since,
    )


def test_the_most_specific_price_in_effect_wins():
    later = T0 + timedelta(days=10)
    book = PriceBook(
        [
            _price(cents=250),
            _price(cents=300, since=later, v=2),
            _price(shape="mig", cents=280),
            _price(shape="mig-1g", cents=400),
            _price(region="eu-west", cents=270),
            _price(tier="confidential-vm", shape="vm", cents=500),
            _price(shape="vm", cents=350),
            _price(plan="preemptible", cents=90),
        ]
    )

    def cents(shape="whole", tier="dedicated", region="r1", plan=Plan.on_demand, at=T0):
        p = book.resolve("H100-80GB", shape, tier, region, plan, to_ms(at))
        return p.unit_amount if p else None

    assert cents() == 250 and cents(at=later) == 300 and cents(at=later - timedelta(1)) == 250
    assert cents("mig-1g") == 400 and cents("mig-3g") == 280  # exact profile, then the family
    assert cents(region="eu-west") == 270 and cents(region="eu-west", at=later) == 270
    assert cents("vm", tier="confidential-vm") == 500 and cents("vm", tier="vm") == 350
    assert cents(plan=Plan.preemptible) == 90
    assert cents(at=T0 - timedelta(seconds=1)) is None  # before any price
    assert book.resolve("A100-80GB", "whole", "dedicated", "r1", Plan.on_demand, to_ms(T0)) is None


@pytest.mark.parametrize(
    "quantity, cents, expected",
    [
        (GPU_HOUR, 249, 249),
        (GPU_HOUR // 2, 249, 125),  # 124.5 rounds half away from zero
        (GPU_HOUR // 2 - 1, 249, 124),
        (-(GPU_HOUR // 2), 249, -125),
        (7 * GPU_HOUR // 1000, 1, 0),
        (0, 10**9, 0),
    ],
)
def test_amounts_are_integers_rounded_half_away_from_zero(quantity, cents, expected):
    assert amount(quantity, cents) == expected


def test_a_month_is_billed_per_price_version_and_only_to_its_tenant(client, world):
    op = world.key(None)
    a, b = world.tenant("bill-a"), world.tenant("bill-b")
    change = datetime(2026, 11, 15, tzinfo=UTC)
    base = {"gpu_model": "H100-80GB", "currency": "usd"}
    first = post(
        client,
        op,
        "/v1/admin/prices",
        {
            **base,
            "shape": "whole",
            "plan": "on_demand",
            "unit_amount": 250,
            "effective_from": T0.isoformat(),
        },
    )
    second = post(
        client,
        op,
        "/v1/admin/prices",
        {
            **base,
            "shape": "whole",
            "plan": "on_demand",
            "unit_amount": 300,
            "effective_from": change.isoformat(),
        },
    )
    assert (first["version"], second["version"]) == (1, 2)
    post(
        client,
        op,
        "/v1/admin/prices",
        {
            **base,
            "shape": "whole",
            "plan": "preemptible",
            "unit_amount": 100,
            "effective_from": T0.isoformat(),
        },
    )
    # A: 8 GPUs from 10:00 on the 14th to 02:30 on the 15th, across the price change; a
    # preemptible GPU for 90 minutes; a MIG slice nobody has priced. B: one GPU for an hour.
    x, y, z, w = (uuid.uuid4() for _ in range(4))
    start = datetime(2026, 11, 14, 10, tzinfo=UTC)
    events = [
        usage_event(a, "x1", "start", start, x, milli=8000),
        usage_event(a, "x2", "stop", change + timedelta(hours=2, minutes=30), x, milli=8000),
        usage_event(a, "y1", "start", start, y, priority="preemptible"),
        usage_event(a, "y2", "stop", start + timedelta(minutes=90), y, priority="preemptible"),
        usage_event(a, "z1", "start", start, z, milli=142, shape="mig-1g"),
        usage_event(a, "z2", "stop", start + timedelta(hours=1), z, milli=142, shape="mig-1g"),
        usage_event(b, "w1", "start", start, w),
        usage_event(b, "w2", "stop", start + timedelta(hours=1), w),
    ]
    post(client, op, "/v1/admin/usage/events", {"events": events}, status=200)

    bill = client.get(
        "/v1/billing/summary", params={"period": "2026-11"}, headers=auth(world.key(a))
    )
    assert bill.status_code == 200, bill.text
    bill = bill.json()
    lines = {(ln["plan"], ln["shape"], ln["price_version"]): ln for ln in bill["lines"]}
    assert set(lines) == {
        ("on_demand", "whole", 1),
        ("on_demand", "whole", 2),
        ("preemptible", "whole", 1),
        ("on_demand", "mig-1g", None),
    }
    before = lines[("on_demand", "whole", 1)]
    assert before["milli_gpu_ms"] == 8000 * 14 * 3_600_000  # 10:00 to midnight
    assert before["amount"] == 8 * 14 * 250 and before["unit_amount"] == 250
    after = lines[("on_demand", "whole", 2)]
    assert after["amount"] == 8 * 300 * 5 // 2 and after["gpu_hours"] == 20.0
    assert lines[("preemptible", "whole", 1)]["amount"] == 150
    assert lines[("on_demand", "mig-1g", None)]["amount"] == 0
    assert bill["unpriced_milli_gpu_ms"] == 142 * 3_600_000
    assert bill["totals"] == {"usd": 8 * 14 * 250 + 6000 + 150}
    assert {ln["tenant_id"] for ln in bill["lines"]} == {str(a.id)}
    other = client.get(
        "/v1/billing/summary", params={"period": "2026-11"}, headers=auth(world.key(b))
    ).json()
    assert other["totals"] == {"usd": 250} and len(other["lines"]) == 1
    assert client.get("/v1/prices", headers=auth(world.key(b))).json()["items"][0]["version"] == 1


def test_the_upcoming_invoice_accrues_running_work_up_to_now(client, world):
    op = world.key(None)
    t = world.tenant("upcoming")
    now = datetime.now(UTC)
    post(
        client,
        op,
        "/v1/admin/prices",
        {
            "gpu_model": "H100-80GB",
            "shape": "whole",
            "plan": "on_demand",
            "currency": "usd",
            "unit_amount": 3600,
            "effective_from": (now - timedelta(days=400)).isoformat(),
        },
    )
    since = max(now - timedelta(hours=2), now.replace(day=1, hour=0, minute=0, second=0))
    post(
        client,
        op,
        "/v1/admin/usage/events",
        {"events": [usage_event(t, "run", "start", since, uuid.uuid4())]},
        status=200,
    )
    first = client.get("/v1/billing/upcoming", headers=auth(world.key(t))).json()
    later = client.get("/v1/billing/upcoming", headers=auth(world.key(t))).json()
    assert first["period"] == f"{now:%Y-%m}" and later["accrued_until"] > first["accrued_until"]
    assert 0 < first["totals"]["usd"] <= later["totals"]["usd"] <= 2 * 3600 + 1


@pytest.mark.parametrize(
    "change",
    [
        {"currency": "USD"},
        {"unit_amount": -1},
        {"effective_from": "2026-11-01T00:00:00"},  # no offset
        {"shape": "mig-"},
        {"tier": "gold"},
        {"gpu_model": "Z9000"},
    ],
)
def test_bad_prices_are_422_problems(client, world, change):
    body = {
        "gpu_model": "H100-80GB",
        "shape": "whole",
        "plan": "on_demand",
        "currency": "usd",
        "unit_amount": 100,
        "effective_from": T0.isoformat(),
        **change,
    }
    r = client.post("/v1/admin/prices", json=body, headers=auth(world.key(None)))
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")


def test_a_bad_period_is_a_422_problem(client, world):
    key = world.key(world.tenant("period"))
    for period in ("2026-13", "november", "2026-1"):
        r = client.get("/v1/billing/summary", params={"period": period}, headers=auth(key))
        assert r.status_code == 422 and r.json()["code"] == "validation_error"
        assert [e["field"] for e in r.json()["errors"]] == ["query.period"]


def test_a_mig_price_by_the_models_name_prices_the_ledgers_usage(client, world):
    """The README's spelling (`mig-3g.40gb`) and the ledger's (`mig-3g`) are one vocabulary: a
    price given by the model's name is stored by the generic key and prices the usage."""
    op, a = world.key(None), world.tenant("mig-bill")
    price = {
        "gpu_model": "H100-80GB",
        "shape": "mig-3g.40gb",
        "plan": "on_demand",
        "currency": "usd",
        "unit_amount": 120,
        "effective_from": "2026-11-01T00:00:00Z",
    }
    stored = post(client, op, "/v1/admin/prices", price)
    assert stored["shape"] == "mig-3g"
    alloc, start = uuid.uuid4(), datetime(2026, 11, 3, tzinfo=UTC)
    events = [
        usage_event(a, "m1", "start", start, alloc, milli=500, shape="mig-3g"),
        usage_event(a, "m2", "stop", start + timedelta(hours=2), alloc, milli=500, shape="mig-3g"),
    ]
    post(client, op, "/v1/admin/usage/events", {"events": events}, status=200)
    bill = client.get(
        "/v1/billing/summary", params={"period": "2026-11"}, headers=auth(world.key(a))
    ).json()
    [line] = bill["lines"]
    assert (line["shape"], line["unit_amount"], line["amount"]) == ("mig-3g", 120, 120)
    assert bill["unpriced_milli_gpu_ms"] == 0
    # A name of another model's profile is refused, listing the valid shapes.
    wrong = client.post("/v1/admin/prices", json={**price, "gpu_model": "B200"}, headers=auth(op))
    assert wrong.status_code == 422 and "mig-3g.90gb" in wrong.text
    unknown = client.post("/v1/admin/prices", json={**price, "shape": "mig-9g"}, headers=auth(op))
    assert unknown.status_code == 422
