"""The PostgreSQL leader killed under load (issue 38): the HA topology of rackplane_bench/ha.py
(a three-member Patroni cluster with synchronous replication over etcd, Redis with two replicas
and three Sentinels, two API processes, two Celery workers and a beat), three tenants submitting,
keying, budgeting and checkpointing, an operator pushing telemetry; then the leader's Patroni and
PostgreSQL die with SIGKILL. Nothing acknowledged is lost, nothing is applied or allocated
twice, no GPU-second is billed twice (in the ledger, or in what the Stripe stand-in holds),
no answer is a 500, and writes come back (how fast is the
benchmark's: `rackplane bench failover`). The engines are Debian's; `make test` installs them."""

from __future__ import annotations

import pytest

from rackplane_bench.ha import missing_engines

pytestmark = pytest.mark.skipif(
    bool(missing_engines()),
    reason=f"missing {', '.join(missing_engines())} (make test installs them)",
)


def test_a_postgres_leader_killed_under_load_loses_and_doubles_nothing():
    from rackplane_bench.failover import run

    r = run(("postgres_leader",), rate=2.0, gap=20.0, warmup=8.0, tail=5.0)
    print(r)
    assert r["acknowledged"]["submit"] > 20 and r["acknowledged"]["checkpoint"] > 0, r
    assert r["lost_acknowledged"] == 0, r["lost_by_kind"]
    assert r["duplicate_submissions"] == 0, r
    assert r["double_allocations"] == 0, r
    assert r["usage_overlaps"] == 0, r
    assert r["stripe_events"] > 0 and r["stripe_overbilled"] == 0, r
    assert r["stripe_unbilled"] == 0, "the exporter caught up with the ledger"
    assert r["errors_500"] == 0, r
    assert r["failover_s"]["postgres_leader"] is not None, "writes never came back"
    assert r["placed_again_s"]["postgres_leader"] is not None, "placement never came back"
    assert r["killed"]["postgres_leader"].startswith("pg")
    assert r["settled"], "work was left half-way (placing, provisioning, or billing)"
