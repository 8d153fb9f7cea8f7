"""Reserved (committed) capacity: at every instant of a term, a tenant's non-preemptible usage of
a model is priced reserved up to its commitments (region-specific first), the rest on demand, and
the unused part is still owed; operators manage commitments, tenants see only their own, and bad
input is a problem+json."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from app.billing.commitments import HOUR_MS, UNUSED, Term, split
from app.metering.service import Interval
from tests.fixtures.billing import post, usage_event
from tests.fixtures.world import auth

H = HOUR_MS
T = uuid.uuid4()
M = "H100-80GB"


def _term(milli, start=0, end=10 * H, region="*", tenant=T):
    return Term(uuid.uuid4(), tenant, M, region, milli, start, end)


def _iv(start, stop, milli, *, shape="whole", region="r1", tier="dedicated", tenant=T):
    return Interval(start, stop, milli, (tenant, uuid.uuid4(), region, M, shape, tier, "training"))


def _by_plan(out, shape=None):
    totals: dict[str, int] = {}
    for (_, (_, _, sh, _, _, plan)), q in out.items():
        if shape is None or sh == shape:
            totals[plan] = totals.get(plan, 0) + q
    return totals


def test_usage_up_to_the_commitment_is_reserved_and_the_rest_on_demand():
    # 3 GPUs for an hour against 2 committed: 2 GPU-hours reserved, 1 on demand, none unused.
    out = split([_iv(0, H, 3000)], [_term(2000)], [0, H], H)
    assert _by_plan(out) == {"reserved": 2000 * H, "on_demand": 1000 * H}
    # 1 GPU against 4 committed: 1 reserved, 3 GPU-hours owed as the unused commitment.
    out = split([_iv(0, H, 1000)], [_term(4000)], [0, H], H)
    assert _by_plan(out, "whole") == {"reserved": 1000 * H}
    assert _by_plan(out, UNUSED) == {"reserved": 3000 * H}
    # The commitment is a rate: 2 GPUs for the first half hour and none for the second do not
    # fill a 1-GPU commitment for the hour.
    out = split([_iv(0, H // 2, 2000)], [_term(1000)], [0, H], H)
    assert _by_plan(out, "whole") == {"reserved": 500 * H, "on_demand": 500 * H}
    assert _by_plan(out, UNUSED) == {"reserved": 500 * H}


def test_usage_outside_the_term_is_on_demand_and_unused_accrues_only_until_now():
    out = split([_iv(0, 3 * H, 1000)], [_term(1000, start=H, end=2 * H)], [0, 3 * H], 3 * H)
    assert out[(0, (T, M, "whole", "dedicated", "r1", "on_demand"))] == 2000 * H
    assert out[(0, (T, M, "whole", "dedicated", "r1", "reserved"))] == 1000 * H
    assert _by_plan(out, UNUSED) == {}
    # Open usage and an idle commitment, 90 minutes into a 10-hour term.
    out = split([_iv(0, None, 500)], [_term(2000)], [0, 24 * H], 3 * H // 2)
    assert _by_plan(out, "whole") == {"reserved": 750 * H}
    assert _by_plan(out, UNUSED) == {"reserved": 2250 * H}
    # Usage stamped ahead of `now` (a clock ahead of ours) is still covered; only the unused
    # part waits for its time to pass.
    out = split([_iv(0, 2 * H, 1000)], [_term(1000)], [0, 4 * H], H)
    assert _by_plan(out) == {"reserved": 2000 * H}


def test_region_commitments_serve_their_region_first_then_any_region_commitments():
    usage = [_iv(0, H, 2000, region="r1"), _iv(0, H, 2000, region="r2", shape="mig-3g")]
    terms = [_term(1000, region="*"), _term(2000, region="r1"), _term(1000, region="r3")]
    out = split(usage, terms, [0, H], H)
    r1 = {k[1][5]: q for k, q in out.items() if k[1][4] == "r1"}
    r2 = {k[1][5]: q for k, q in out.items() if k[1][4] == "r2"}
    assert r1 == {"reserved": 2000 * H}  # all from r1's own commitment
    assert r2 == {"reserved": 1000 * H, "on_demand": 1000 * H}  # '*' only; r3's is not theirs
    unused = {k[1][4]: q for k, q in out.items() if k[1][2] == UNUSED}
    assert unused == {"r3": 1000 * H}


def test_the_split_conserves_usage_and_commitment_and_does_not_depend_on_the_cuts():
    import random

    rnd = random.Random(7)
    usage = []
    for _ in range(300):
        start = rnd.randrange(0, 48 * H, 60_000)
        usage.append(
            _iv(
                start,
                min(48 * H, start + rnd.randrange(60_000, 6 * H)),
                rnd.choice([1000, 2000, 142, 8000]),
                shape=rnd.choice(["whole", "mig-1g", "vm"]),
                tier=rnd.choice(["dedicated", "vm"]),
                region=rnd.choice(["r1", "r2"]),
            )
        )
    terms = [_term(3000, 5 * H, 30 * H, "r1"), _term(2000, 10 * H, 60 * H)]
    days = [0, 24 * H, 48 * H]
    out = split(usage, terms, days, 48 * H)
    used = sum(q for k, q in out.items() if k[1][2] != UNUSED)
    assert used == sum((iv.stop_ms - iv.start_ms) * iv.gpu_milli for iv in usage)
    reserved = sum(q for k, q in out.items() if k[1][5] == "reserved")
    assert reserved == 3000 * 25 * H + 2000 * 38 * H  # each commitment's hours in [0, 48h)
    assert all(q > 0 for q in out.values())
    # Cut every 7 minutes as well (as Stripe buckets are) and summed back per day, or given in
    # another order: the same split.
    cuts = sorted({*range(0, 48 * H, 7 * 60_000), *days})
    fine = split(list(reversed(usage)), terms, cuts, 48 * H)
    by_day: dict = {}
    for (seg, key), q in fine.items():
        day = (seg // (24 * H)) * 24 * H
        by_day[(day, key)] = by_day.get((day, key), 0) + q
    assert by_day == dict(out)


def _prices(client, op):
    for plan, cents in (("on_demand", 300), ("reserved", 200), ("preemptible", 100)):
        post(
            client,
            op,
            "/v1/admin/prices",
            {
                "gpu_model": M,
                "shape": "whole",
                "plan": plan,
                "currency": "usd",
                "unit_amount": cents,
                "effective_from": "2026-10-01T00:00:00Z",
            },
        )


def test_a_commitment_prices_the_bill_and_the_export_and_only_its_tenant_sees_it(client, world):
    op = world.key(None)
    a, b = world.tenant("commit-a"), world.tenant("commit-b")
    _prices(client, op)
    day = datetime(2026, 11, 10, tzinfo=UTC)
    c = post(
        client,
        op,
        f"/v1/admin/tenants/{a.id}/commitments",
        {
            "gpu_model": M,
            "gpus": 4,
            "starts_at": day.isoformat(),
            "ends_at": (day + timedelta(hours=3)).isoformat(),
            "reference": "contract 42",
        },
    )
    assert c["gpus_milli"] == 4000 and c["region"] == "*"
    # A: 6 GPUs for the first hour, 2 for the second, nothing in the third; 1 preemptible GPU
    # throughout. B runs the same 6 GPUs with no commitment.
    x, y, p, z = (uuid.uuid4() for _ in range(4))
    h1, h2, h3 = (day + timedelta(hours=i) for i in (1, 2, 3))
    events = [
        usage_event(a, "x1", "start", day, x, milli=6000),
        usage_event(a, "x2", "stop", h1, x, milli=6000),
        usage_event(a, "y1", "start", h1, y, milli=2000),
        usage_event(a, "y2", "stop", h2, y, milli=2000),
        usage_event(a, "p1", "start", day, p, priority="preemptible"),
        usage_event(a, "p2", "stop", h3, p, priority="preemptible"),
        usage_event(b, "z1", "start", day, z, milli=6000),
        usage_event(b, "z2", "stop", h1, z, milli=6000),
    ]
    post(client, op, "/v1/admin/usage/events", {"events": events}, status=200)

    bill = client.get(
        "/v1/billing/summary", params={"period": "2026-11"}, headers=auth(world.key(a))
    )
    assert bill.status_code == 200, bill.text
    lines = {(ln["plan"], ln["shape"]): ln for ln in bill.json()["lines"]}
    gpu_h = 1000 * H
    assert lines[("reserved", "whole")]["milli_gpu_ms"] == 6 * gpu_h  # 4 + 2
    assert lines[("on_demand", "whole")]["milli_gpu_ms"] == 2 * gpu_h
    assert lines[("preemptible", "whole")]["milli_gpu_ms"] == 3 * gpu_h
    unused = lines[("reserved", UNUSED)]
    assert unused["milli_gpu_ms"] == 6 * gpu_h and unused["unit_amount"] == 200  # 0 + 2 + 4
    assert bill.json()["totals"] == {"usd": 6 * 200 + 2 * 300 + 3 * 100 + 6 * 200}
    other = client.get(
        "/v1/billing/summary", params={"period": "2026-11"}, headers=auth(world.key(b))
    ).json()
    assert other["totals"] == {"usd": 6 * 300}

    rows = client.get(
        "/v1/admin/billing/exports",
        params={"period": "2026-11", "format": "jsonl"},
        headers=auth(op),
    ).text.splitlines()
    rows = [json.loads(r) for r in rows]
    assert sum(r["amount"] for r in rows if r["tenant_id"] == str(a.id)) == 3300
    assert {r["plan"] for r in rows if r["shape"] == UNUSED} == {"reserved"}

    mine = client.get("/v1/commitments", headers=auth(world.key(a))).json()["items"]
    assert [m["id"] for m in mine] == [c["id"]] and mine[0]["reference"] == "contract 42"
    assert client.get("/v1/commitments", headers=auth(world.key(b))).json()["items"] == []
    listed = client.get(f"/v1/admin/tenants/{a.id}/commitments", headers=auth(op)).json()
    assert len(listed["items"]) == 1
    # A started commitment runs its term; a tenant cannot reach the operator routes.
    r = client.delete(f"/v1/admin/tenants/{a.id}/commitments/{c['id']}", headers=auth(op))
    assert r.status_code == 409 and r.json()["code"] == "commitment_started"
    r = client.get(f"/v1/admin/tenants/{a.id}/commitments", headers=auth(world.key(a)))
    assert r.status_code == 403


def test_a_commitment_not_yet_begun_can_be_withdrawn(client, world):
    op = world.key(None)
    a, b = world.tenant("withdraw-a"), world.tenant("withdraw-b")
    later = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(days=3)
    body = {
        "gpu_model": M,
        "gpus": 1,
        "starts_at": later.isoformat(),
        "ends_at": (later + timedelta(days=30)).isoformat(),
    }
    c = post(client, op, f"/v1/admin/tenants/{a.id}/commitments", body)
    # Through another tenant's path it does not exist.
    r = client.delete(f"/v1/admin/tenants/{b.id}/commitments/{c['id']}", headers=auth(op))
    assert r.status_code == 404 and r.json()["code"] == "commitment_not_found"
    r = client.delete(f"/v1/admin/tenants/{a.id}/commitments/{c['id']}", headers=auth(op))
    assert r.status_code == 204
    assert client.get("/v1/commitments", headers=auth(world.key(a))).json()["items"] == []


@pytest.mark.parametrize(
    "change, code",
    [
        ({"starts_at": "2026-11-10T00:30:00Z"}, "commitment_not_hourly"),
        ({"ends_at": "2026-12-10T00:00:00.000500Z"}, "commitment_not_hourly"),
        ({"ends_at": "2026-11-09T00:00:00Z"}, "commitment_empty_term"),
        ({"region": "atlantis"}, "unknown_region"),
        ({"gpus": 0}, "validation_error"),
        ({"gpu_model": "Z9000"}, "validation_error"),
        ({"starts_at": "2026-11-10T00:00:00"}, "validation_error"),  # no time zone
    ],
)
def test_bad_commitments_are_422_problems(client, world, change, code):
    op = world.key(None)
    t = world.tenant("bad-commit")
    body = {
        "gpu_model": M,
        "gpus": 2,
        "starts_at": "2026-11-10T00:00:00Z",
        "ends_at": "2026-12-10T00:00:00Z",
        **change,
    }
    r = client.post(f"/v1/admin/tenants/{t.id}/commitments", json=body, headers=auth(op))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == code
    assert client.get(f"/v1/admin/tenants/{t.id}/commitments", headers=auth(op)).json() == {
        "items": []
    }
