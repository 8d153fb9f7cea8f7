"""The API's key cache, on a real uvicorn process and the real Redis: a key checked once is
trusted without the database for a while, and any committed change to keys or tenants, made by
another process, ends that trust as soon as Redis delivers the news (milliseconds: the checks
allow 2 s, against the cache's own bound of 30 s, so a missing notice still fails them)."""

from __future__ import annotations

import time

import httpx
from sqlalchemy import text, update

from tests.fixtures.world import auth, wait_until


def soon(call, status: int, code: str | None = None) -> None:
    """`call()` answers `status` (and problem `code`) once the change has reached the process."""

    def ok() -> bool:
        r = call()
        return r.status_code == status and (code is None or r.json().get("code") == code)

    wait_until(ok, timeout=2, interval=0.05)


def test_the_api_process_trusts_a_checked_key_until_keys_or_tenants_change(
    api, client, world, session
):
    from app.models.tenants import Tenant

    t = world.tenant("acme")
    key, admin = world.key(t, scopes=("read",)), world.key(t)
    other = world.key(world.tenant("globex"), scopes=("read",))
    remote = httpx.Client(base_url=api, timeout=10)
    # The process's first request starts its listener; keys are cached once it is subscribed.
    assert remote.get("/v1/workloads", headers=auth(key)).status_code == 200
    time.sleep(1)
    for k in (key, admin, other):
        assert remote.get("/v1/workloads", headers=auth(k)).status_code == 200

    # A change behind the ORM's back (raw SQL) does not bump the epoch: the API process goes
    # on trusting what it checked, which shows the database is not read per request.
    session.execute(text("UPDATE api_keys SET scopes = '[]' WHERE prefix = :p"), {"p": key[3:11]})
    session.commit()
    assert remote.get("/v1/workloads", headers=auth(key)).status_code == 200

    # Revoking a key through this process's API reaches the other process within moments.
    kid = session.scalar(text("SELECT id FROM api_keys WHERE prefix = :p"), {"p": key[3:11]})
    assert client.delete(f"/v1/keys/{kid}", headers=auth(admin)).status_code == 200
    soon(lambda: remote.get("/v1/workloads", headers=auth(key)), 401, "revoked_api_key")

    # So does a hard limit an operator sets: a submission over it is refused there within moments.
    assert remote.get("/v1/workloads", headers=auth(admin)).status_code == 200  # cached again
    limit = {"gpu_model": "H100-80GB", "guaranteed_milli": 0, "limit_milli": 1000}
    r = client.put(
        f"/v1/admin/tenants/{t.id}/quotas", json={"quotas": [limit]}, headers=auth(world.key())
    )
    assert r.status_code == 200, r.text
    body = {"kind": "instance", "gpus": 2, "gpu_models": ["H100-80GB"], "max_runtime_s": 60}
    soon(
        lambda: remote.post("/v1/workloads", json=body, headers=auth(admin)),
        422,
        "quota_limit_exceeded",
    )

    # And a tenant suspended by an ORM change, and one made by a bulk UPDATE statement.
    assert remote.get("/v1/workloads", headers=auth(admin)).status_code == 200
    row = session.get(Tenant, t.id)
    row.status = "suspended"
    session.commit()
    soon(lambda: remote.get("/v1/workloads", headers=auth(admin)), 403, "tenant_not_active")
    session.execute(update(Tenant).where(Tenant.id == t.id).values(status="active"))
    session.commit()
    soon(lambda: remote.get("/v1/workloads", headers=auth(admin)), 200)

    # Keys of other tenants were dropped with the rest, and are read again correctly.
    assert remote.get("/v1/workloads", headers=auth(other)).status_code == 200
