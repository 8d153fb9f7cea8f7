"""GraphQL subscriptions over `graphql-transport-ws` (/graphql): a tenant's workload events
from the same log REST reads, live and in order, only its own, resumable by cursor with nothing
missed or repeated; operators' fleet changes; refusals with REST's codes; and the wake-ups
underneath (Redis across processes, in process without it, the log's settled horizon)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
from sqlalchemy import insert, select

from app.core import logtail, pubsub
from app.core.db import get_sessionmaker, utcnow
from tests.fixtures.graphql import Socket
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import CORDONED_H100, auth, wait_until

EVENTS = """
subscription($after: String, $wid: ID) {
  workloadEvents(after: $after, workloadId: $wid) {
    cursor workloadId tenantId seq kind fromState toState reason at
  }
}
"""


def has(wid: str, state: str):
    return lambda items: any(i["workloadId"] == wid and i["toState"] == state for i in items)


def transitions(items: list[dict], wid: str) -> list[str]:
    return [i["toState"] for i in items if i["workloadId"] == wid and i["kind"] == "transition"]


def rest_events(base: str, key: str, wid: str) -> list[dict]:
    r = httpx.get(f"{base}/v1/workloads/{wid}/events", headers=auth(key), timeout=10)
    return r.json()["items"]


def submit(base: str, key: str) -> str:
    r = httpx.post(
        f"{base}/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(key), timeout=10
    )
    assert r.status_code == 201, r.text
    return r.json()["id"]


def state(base: str, key: str, wid: str) -> str:
    return httpx.get(f"{base}/v1/workloads/{wid}", headers=auth(key), timeout=10).json()["state"]


# --- against a real API process and worker ------------------------------------------------------


def test_a_submission_arrives_queued_placing_running_in_order_to_its_tenant_only(
    api, world, celery_worker_process
):
    world.fleet(fleet(1))
    acme, globex = world.tenant("acme", policy=ALL), world.tenant("globex", policy=ALL)
    acme_key, globex_key, op_key = world.key(acme), world.key(globex), world.key(None)
    mine = Socket(api, acme_key)
    theirs = Socket(api, globex_key, header=True)  # the handshake's header signs in too
    operator = Socket(api, op_key)
    try:
        for s in (mine, theirs, operator):
            s.subscribe(EVENTS, after="0")
        wid = submit(api, acme_key)
        got = mine.items(has(wid, "running"))
        # Every transition, in the order it happened, as REST lists it.
        assert transitions(got, wid) == [
            "pending",
            "queued",
            "placing",
            "provisioning",
            "running",
        ]
        assert [(i["seq"], i["toState"]) for i in got] == [
            (e["seq"], e["to_state"]) for e in rest_events(api, acme_key, wid)[: len(got)]
        ]
        cursors = [int(i["cursor"]) for i in got]
        assert cursors == sorted(set(cursors))
        assert {i["tenantId"] for i in got} == {str(acme.id)}
        # An operator sees every tenant's events: these too, the same.
        seen = operator.items(has(wid, "running"))
        assert [i["cursor"] for i in seen if i["workloadId"] == wid] == [i["cursor"] for i in got]
        # Another tenant: none of them. Its own workload's events mark the end of its stream.
        theirs_wid = submit(api, globex_key)
        other = theirs.items(has(theirs_wid, "queued"))
        assert {i["workloadId"] for i in other} == {theirs_wid}
        assert {i["tenantId"] for i in other} == {str(globex.id)}
    finally:
        for s in (mine, theirs, operator):
            s.close()


def test_a_reconnect_with_the_last_cursor_misses_nothing_and_repeats_nothing(
    api, world, celery_worker_process
):
    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    first = Socket(api, key)
    first.subscribe(EVENTS, after="0")
    a = submit(api, key)
    before = first.items(has(a, "running"))
    first.close()
    # While away: A ends, B comes and runs and ends.
    httpx.delete(f"{api}/v1/workloads/{a}", headers=auth(key), timeout=10).raise_for_status()
    b = submit(api, key)
    wait_until(lambda: state(api, key, b) == "running", timeout=30)
    httpx.delete(f"{api}/v1/workloads/{b}", headers=auth(key), timeout=10).raise_for_status()
    wait_until(lambda: state(api, key, a) == state(api, key, b) == "terminated", timeout=30)

    again = Socket(api, key)
    again.subscribe(EVENTS, after=before[-1]["cursor"])
    after = again.items(lambda got: has(a, "terminated")(got) and has(b, "terminated")(got))
    time.sleep(0.5)
    assert again.recv(0.5) is None  # and nothing else
    again.close()

    every = before + after
    cursors = [int(i["cursor"]) for i in every]
    assert cursors == sorted(set(cursors)), "in log order, none twice"
    for wid in (a, b):
        assert [(i["seq"], i["toState"]) for i in every if i["workloadId"] == wid] == [
            (e["seq"], e["to_state"]) for e in rest_events(api, key, wid)
        ]


def test_operators_follow_fleet_health_changes(api, world):
    from app.models.fleet import Node

    world.fleet(fleet(1))
    op_key = world.key(None)
    with get_sessionmaker()() as s:
        node_id, name = s.execute(select(Node.id, Node.name)).one()
    s = Socket(api, op_key)
    try:
        s.subscribe(
            'subscription { fleetChanges(after: "0") { cursor node nodeId gpuIndex '
            "fromState toState actor cause } }"
        )
        for action in ("quarantine", "release"):
            r = httpx.post(
                f"{api}/v1/admin/nodes/{node_id}/health",
                json={"action": action, "reason": "test"},
                headers=auth(op_key),
                timeout=10,
            )
            assert r.status_code == 200, r.text
        got = s.items(lambda items: len(items) >= 2)
        assert [(i["node"], i["nodeId"], i["gpuIndex"]) for i in got] == [
            (name, str(node_id), None)
        ] * 2
        assert [(i["fromState"], i["toState"], i["actor"]) for i in got] == [
            ("healthy", "quarantined", "operator"),
            ("quarantined", "healthy", "operator"),
        ]
    finally:
        s.close()


def test_subscriptions_are_refused_with_rest_codes(api, world):
    world.fleet(fleet(1))
    acme = world.tenant("acme", policy=ALL)
    key = world.key(acme)
    globex_wid = submit(api, world.key(world.tenant("globex", policy=ALL)))
    pending = world.key(world.tenant("newco", status="pending"))
    cases = [
        (None, EVENTS, {}, "missing_api_key"),
        ("rp_" + "x" * 48, EVENTS, {}, "invalid_api_key"),
        (pending, EVENTS, {}, "tenant_not_active"),
        (key, "subscription { fleetChanges { cursor } }", {}, "platform_scope_required"),
        (key, EVENTS, {"after": "soon"}, "invalid_cursor"),
        (key, EVENTS, {"wid": globex_wid}, "workload_not_found"),
    ]
    for caller, query, variables, code in cases:
        s = Socket(api, caller)
        try:
            s.subscribe(query, **variables)
            assert s.refusal()["extensions"]["code"] == code, (caller, query, variables)
        finally:
            s.close()
    # The query limits hold for subscriptions too (checked before anything runs).
    s = Socket(api, key)
    try:
        aliases = " ".join(f"a{i}: seq" for i in range(40))
        s.subscribe(f"subscription {{ workloadEvents {{ {aliases} }} }}")
        assert "aliases" in s.refusal()["message"]
    finally:
        s.close()


def test_a_key_revoked_while_subscribed_ends_the_subscription(client, world, monkeypatch):
    from app.graphql import subscriptions
    from app.models.keys import ApiKey

    monkeypatch.setattr(subscriptions, "RECHECK_S", 0.0)
    monkeypatch.setattr(subscriptions, "POLL_S", 0.2)
    tenant = world.tenant("acme", policy=ALL)
    key = world.key(tenant)
    with client.websocket_connect("/graphql", subprotocols=["graphql-transport-ws"]) as ws:
        ws.send_json({"type": "connection_init", "payload": auth(key)})
        assert ws.receive_json()["type"] == "connection_ack"
        ws.send_json({"id": "1", "type": "subscribe", "payload": {"query": EVENTS}})
        with get_sessionmaker()() as s:
            for k in s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)):
                k.revoked_at = utcnow()
            s.commit()
        end = ws.receive_json()
        if end["type"] == "error":  # revoked before the operation started: refused at once
            assert [e["extensions"]["code"] for e in end["payload"]] == ["revoked_api_key"]
            return
        assert end["type"] == "next", end
        assert [e["extensions"]["code"] for e in end["payload"]["errors"]] == ["revoked_api_key"]
        assert ws.receive_json() == {"id": "1", "type": "complete"}


# --- the wake-ups and the log's horizon, in this process ----------------------------------------


def _workload(client, world) -> tuple:
    from app.models.workloads import Workload

    world.fleet(CORDONED_H100)  # it stays queued: nothing else writes its row
    tenant = world.tenant("acme", policy=ALL)
    r = client.post(
        "/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(world.key(tenant))
    )
    with get_sessionmaker()() as s:
        return tenant.id, s.get(Workload, uuid.UUID(r.json()["id"])).id


def _event_row(tenant_id, wid, seq: int) -> dict:
    return {
        "workload_id": wid,
        "tenant_id": tenant_id,
        "seq": seq,
        "kind": "checkpoint",
        "from_state": None,
        "to_state": "queued",
        "reason": "test",
        "details": {},
        "at": utcnow(),
    }


class Waiting:
    """A waiter registered on an event loop of its own thread, as a subscription's is."""

    def __init__(self, matches):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def register():
            return pubsub.hub.register(matches)

        self.waiter = asyncio.run_coroutine_threadsafe(register(), self.loop).result(10)

    def woken(self, timeout: float) -> bool:
        return asyncio.run_coroutine_threadsafe(self.waiter.wait(timeout), self.loop).result(
            timeout + 10
        )

    def clear(self) -> None:
        self.loop.call_soon_threadsafe(self.waiter.clear)
        time.sleep(0.05)

    def close(self) -> None:
        pubsub.hub.unregister(self.waiter)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_without_redis_a_commit_wakes_this_process_and_a_rollback_does_not(
    client, world, monkeypatch
):
    from app.core.config import get_settings
    from app.models.workloads import Workload
    from app.scheduling import lifecycle

    tenant_id, wid = _workload(client, world)
    monkeypatch.setattr(get_settings(), "redis_url", None)  # the embedded default's broker
    topic = lifecycle.events_topic(tenant_id)
    mine, other = Waiting(topic.__eq__), Waiting(lifecycle.events_topic(uuid.uuid4()).__eq__)
    try:
        with get_sessionmaker()() as s:
            w = s.get(Workload, wid)
            lifecycle.record(s, w, kind="checkpoint", from_state=None, to_state=w.state, reason="x")
            assert not mine.woken(0.3), "not before the commit"
            s.rollback()
        assert not mine.woken(0.3), "nor for a rollback"
        with get_sessionmaker()() as s:
            w = s.get(Workload, wid)
            lifecycle.record(s, w, kind="checkpoint", from_state=None, to_state=w.state, reason="x")
            s.commit()
        assert mine.woken(5)
        assert not other.woken(0.3), "another tenant's waiter sleeps on"
    finally:
        mine.close()
        other.close()


def test_with_redis_a_commit_wakes_the_listening_process_through_redis():
    topic = f"test-topic:{uuid.uuid4()}"
    w = Waiting(topic.__eq__)
    try:
        wait_until(lambda: pubsub._listener.live, timeout=10, interval=0.05)
        w.clear()  # the listener wakes everyone when it (re)subscribes
        pubsub.publish({topic})  # with Redis configured: only through Redis
        assert w.woken(5)
    finally:
        w.close()


def test_a_topic_cache_keeps_an_answer_until_its_topic_is_published(monkeypatch):
    """The agents' long poll answers from it: a published topic drops its entry (a read that
    began before the publish is not kept), and nothing is trusted without the listener."""
    from app.core.config import get_settings

    topic, other = f"test-topic:{uuid.uuid4()}", f"test-topic:{uuid.uuid4()}"
    cache = pubsub.TopicCache(ttl_s=60)
    w = Waiting(topic.__eq__)  # registering starts the listener
    try:
        wait_until(lambda: pubsub._listener.live, timeout=10, interval=0.05)
        cache.put(topic, cache.begin(topic), "v1")
        cache.put(other, cache.begin(other), "o1")
        assert cache.get(topic) == "v1"
        stale = cache.begin(topic)  # a read begins ...
        pubsub.publish({topic})  # ... and the topic changes before it is kept
        wait_until(lambda: cache.get(topic) is None, timeout=5, interval=0.02)
        cache.put(topic, stale, "v1-stale")
        assert cache.get(topic) is None, "a read that began before the change is not kept"
        assert cache.get(other) == "o1", "another topic's answer stays"
        cache.put(topic, cache.begin(topic), "v2")
        assert cache.get(topic) == "v2"
        monkeypatch.setattr(get_settings(), "redis_url", None)
        assert cache.get(topic) is None and cache.begin(topic) is None, "no listener: no trust"
    finally:
        w.close()
        pubsub.hub.caches.remove(cache)


def test_the_sqlite_watcher_sees_another_connections_commit(tmp_path):
    import sqlite3

    path = str(tmp_path / "x.sqlite")
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
    db.commit()
    w = Waiting(lambda _t: False)  # woken only by "something committed", not by a topic
    watcher = pubsub.SqliteWatcher()
    watcher.ensure(path)
    try:
        time.sleep(3 * watcher.INTERVAL_S)  # it has read the version
        assert not w.woken(0.3)
        db.execute("INSERT INTO t VALUES (1)")
        db.commit()
        assert w.woken(5)
    finally:
        watcher.stop()
        w.close()
        db.close()


def test_the_horizon_stops_below_a_lower_id_that_commits_after_a_higher_one(client, world):
    from app.models.workloads import WorkloadEvent

    tenant_id, wid = _workload(client, world)
    table = WorkloadEvent.__table__
    tail = logtail.LogTail("workload_events")
    tail.GRACE_S = 0.05

    def horizon() -> int:
        return tail.refresh(time.monotonic())[0]

    for outcome in ("commit", "rollback"):
        early, late = get_sessionmaker()(), get_sessionmaker()()
        try:
            low = early.execute(
                insert(table).returning(table.c.id), _event_row(tenant_id, wid, 1000)
            ).scalar_one()
            high = late.execute(
                insert(table).returning(table.c.id), _event_row(tenant_id, wid, 1001)
            ).scalar_one()
            late.commit()
            assert high > low
            assert horizon() < low, "not past an id not visible yet"
            time.sleep(0.1)  # past the grace: only the open transaction can hold the gap now
            assert horizon() < low, "nor while the transaction that may hold it is open"
            early.commit() if outcome == "commit" else early.rollback()
            # Committed: it is visible; rolled back: the gap is settled. Either way, past it.
            wait_until(lambda: horizon() >= high, timeout=10, interval=0.1)  # noqa: B023
        finally:
            early.close()
            late.close()
        with get_sessionmaker()() as s:
            s.execute(table.delete().where(table.c.seq >= 1000))
            s.commit()


def test_a_key_revoked_while_its_websocket_is_open_is_refused_on_the_next_operation(api, world):
    """Queries and mutations on an open websocket are checked as REST requests are: a key
    revoked (over REST) is refused from its next operation on, with REST's code."""
    acme = world.tenant("acme", policy=ALL)
    key = world.key(acme)
    ws = Socket(api, key)
    try:
        ws.subscribe("{ viewer { slug } }", op="a")
        first = ws.recv(20)
        assert first["payload"]["data"] == {"viewer": {"slug": "acme"}}, first
        keys = httpx.get(f"{api}/v1/keys", headers=auth(key), timeout=10).json()["items"]
        mine = next(k for k in keys if key.startswith("rp_" + k["prefix"]))
        r = httpx.delete(f"{api}/v1/keys/{mine['id']}", headers=auth(key), timeout=10)
        assert r.status_code == 200
        ws.recv(2)  # the first operation's `complete`
        ws.subscribe('mutation { createApiKey(input: {name: "sneaky"}) { __typename } }', op="b")
        got = ws.recv(20)
        while got is not None and got.get("id") != "b":
            got = ws.recv(20)
        assert got is not None
        errors = got["payload"] if got["type"] == "error" else got["payload"].get("errors")
        assert errors and errors[0]["extensions"]["code"] == "revoked_api_key", got
    finally:
        ws.close()
