"""Workload logs: node agents ship each replica's output in chunks at their byte offset
(`POST /v1/agent/logs`); tenants read their own workloads' output a page at a time, follow it
live as server-sent events, or subscribe over GraphQL. The agent here is the test, speaking the
wire, for a workload the placement worker put on its node."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx

from tests.fixtures.graphql import Socket
from tests.fixtures.logs import log_chunk, placed_workload, read_logs
from tests.fixtures.world import auth, wait_until


def _lines(wid: str, texts: list[str], start: int = 0, **kw) -> list[dict]:
    out, offset = [], start
    for t in texts:
        out.append(log_chunk(wid, offset, t, **kw))
        offset += len(t.encode())
    return out


def _post(client, cred: str, chunks: list[dict]) -> dict:
    r = client.post("/v1/agent/logs", json={"chunks": chunks}, headers=auth(cred))
    assert r.status_code == 200, r.text
    return r.json()


def test_agents_ship_output_once_and_tenants_read_only_their_own(
    client, world, session, celery_worker_process, monkeypatch
):
    from sqlalchemy import func, select, update

    from app.core.config import get_settings
    from app.logs.tasks import prune
    from app.models.logs import WorkloadLog, WorkloadLogSize

    key, wid, creds, holders = placed_workload(client, world)
    holder = creds[holders[0]]
    other_node = creds[next(n for n in creds if n != holders[0])]

    # The node that holds the run ships its output; the same batch again is stored once.
    batch = _lines(wid, ["step 1\n", "step 2\n", "é \ufffd\n"])
    assert _post(client, holder, batch) == {"accepted": 3, "stale": 0}
    assert _post(client, holder, batch) == {"accepted": 3, "stale": 0}
    page = read_logs(client, key, wid)
    assert [(i["offset"], i["data"]) for i in page["items"]] == [
        (0, "step 1\n"),
        (7, "step 2\n"),
        (14, "é \ufffd\n"),
    ]
    assert {(i["attempt"], i["replica"]) for i in page["items"]} == {(1, 0)}
    assert page["next_after"] == page["items"][-1]["id"]
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(WorkloadLog)) == 3
    # The agent replaces NUL (PostgreSQL's text cannot hold it): a batch with one is refused.
    nul = client.post(
        "/v1/agent/logs", json={"chunks": [log_chunk(wid, 21, "a\x00b")]}, headers=auth(holder)
    )
    assert nul.status_code == 422 and "body.chunks[0].data" in nul.text

    # A node that never held the run, a replica or attempt it does not have, an unknown
    # workload: stale, and nothing stored.
    stale = [
        log_chunk(wid, 100, "x"),  # from the other node
    ]
    assert _post(client, other_node, stale) == {"accepted": 0, "stale": 1}
    odd = [
        log_chunk(wid, 100, "x", replica=1),
        log_chunk(wid, 100, "x", attempt=2),
        log_chunk(str(uuid.uuid4()), 0, "x"),
        log_chunk(wid, 21, "step 3\n"),
    ]
    assert _post(client, holder, odd) == {"accepted": 1, "stale": 3}
    # No node credential, or an API key: 401.
    r = client.post("/v1/agent/logs", json={"chunks": []}, headers=auth(key))
    assert r.status_code == 401 and r.json()["code"] == "invalid_node_credential"

    # Another tenant's workload is not there; an operator key is not a tenant's.
    other = world.key(world.tenant("globex"))
    r = client.get(f"/v1/workloads/{wid}/logs", headers=auth(other))
    assert r.status_code == 404 and r.json()["code"] == "workload_not_found"
    assert wid not in json.dumps(
        {k: v for k, v in r.json().items() if k not in ("detail", "instance")}
    )
    r = client.get(f"/v1/workloads/{wid}/logs", params={"follow": "true"}, headers=auth(other))
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    r = client.get(f"/v1/workloads/{wid}/logs", headers=auth(world.key()))
    assert r.status_code == 403

    # Pages: `limit` chunks at a time, `next_after` reads on; an empty page at the end keeps
    # the cursor.
    _post(client, holder, _lines(wid, [f"line {i}\n" for i in range(10)], start=28))
    every = read_logs(client, key, wid, limit=1000)["items"]
    assert len(every) == 14
    seen, after = [], None
    while True:
        params = {"limit": 4} | ({"after": after} if after is not None else {})
        page = read_logs(client, key, wid, **params)
        if not page["items"]:
            assert page["next_after"] == after
            break
        assert len(page["items"]) <= 4
        seen += page["items"]
        after = page["next_after"]
    assert seen == every
    assert [i["id"] for i in every] == sorted(i["id"] for i in every)
    # Filters: a replica or attempt it does not have, an instant after everything.
    assert read_logs(client, key, wid, replica=1)["items"] == []
    assert read_logs(client, key, wid, attempt=1)["items"] == every
    assert read_logs(client, key, wid, attempt=0)["items"] == []
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert read_logs(client, key, wid, since=future)["items"] == []

    # Bad parameters: 422 problems naming the field.
    for params, field in [
        ({"limit": 0}, "query.limit"),
        ({"limit": 100000}, "query.limit"),
        ({"after": -1}, "query.after"),
        ({"after": 2**63}, "query.after"),
        ({"replica": "x"}, "query.replica"),
        ({"attempt": -1}, "query.attempt"),
        ({"since": "0.5"}, "query.since"),
        ({"follow": "maybe"}, "query.follow"),
    ]:
        r = client.get(f"/v1/workloads/{wid}/logs", params=params, headers=auth(key))
        assert r.status_code == 422, (params, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert field in {e["field"] for e in r.json()["errors"]}, (params, r.text)
    r = client.get(
        f"/v1/workloads/{wid}/logs",
        params={"follow": "true"},
        headers={**auth(key), "Last-Event-ID": "abc"},
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "header.Last-Event-ID"
    bad = client.post(
        "/v1/agent/logs",
        json={"chunks": [{**log_chunk(wid, 0, "x"), "offset": -1}]},
        headers=auth(holder),
    )
    assert bad.status_code == 422 and "body.chunks[0].offset" in bad.text

    # The byte cap: the oldest chunks go first, whole, once the workload is past it.
    monkeypatch.setattr(get_settings(), "log_max_bytes_per_workload", 40)
    _post(client, holder, _lines(wid, ["0123456789\n"] * 3, start=1000))
    kept = read_logs(client, key, wid)["items"]
    assert [(i["offset"], i["data"]) for i in kept] == [(91, "line 9\n")] + [
        (o, "0123456789\n") for o in (1000, 1011, 1022)
    ]
    # Sent again after the cap deleted them, old chunks are not stored a second time.
    assert _post(client, holder, batch) == {"accepted": 3, "stale": 0}
    assert read_logs(client, key, wid)["items"] == kept
    monkeypatch.undo()

    # Retention: chunks that arrived long ago go with the hourly prune.
    session.execute(
        update(WorkloadLog)
        .where(WorkloadLog.offset == 1000)
        .values(received_at=datetime.now(UTC) - timedelta(hours=73))
    )
    session.commit()
    assert prune() == 1
    assert [i["offset"] for i in read_logs(client, key, wid)["items"]] == [91, 1011, 1022]
    # The workload's size, kept by every write, is what its chunks add up to.
    session.expire_all()
    assert (
        session.scalar(select(WorkloadLogSize.bytes))
        == 29
        == session.scalar(select(func.sum(WorkloadLog.bytes)))
    )


def _events(lines, until, timeout: float = 30.0) -> list[dict]:
    """Server-sent events off a stream's lines until `until(events)`: {event, id, data}."""
    got: list[dict] = []
    current: dict = {}
    deadline = time.monotonic() + timeout
    for line in lines:
        if time.monotonic() > deadline:
            raise AssertionError(f"not in time; got {got}")
        if line == "":
            if current:
                got.append(current)
                current = {}
                if until(got):
                    return got
            continue
        if line.startswith(":"):
            got.append({"event": "comment"})
            continue
        name, _, value = line.partition(": ")
        current[name] = json.loads(value) if name == "data" else value
    raise AssertionError(f"the stream ended; got {got}")


def test_followers_get_chunks_as_they_arrive_then_the_end(api, world, celery_worker_process):
    c = httpx.Client(base_url=api, timeout=30)
    key, wid, creds, holders = placed_workload(c, world, replicas=2)
    first_node, second_node = creds[holders[0]], creds[holders[1]]
    _post(c, first_node, _lines(wid, ["booting\n"]))
    headers = auth(key)

    # More streams than the API takes requests at once (8): each gives its slot back once it
    # only waits, so the API still answers.
    streams = []
    for _ in range(9):
        cm = c.stream(
            "GET", f"/v1/workloads/{wid}/logs", params={"follow": "true"}, headers=headers
        )
        r = cm.__enter__()
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        streams.append((cm, r))
    t0 = time.monotonic()
    assert c.get(f"/v1/workloads/{wid}", headers=headers).status_code == 200
    assert time.monotonic() - t0 < 5
    try:
        lines = streams[0][1].iter_lines()
        got = _events(lines, lambda ev: any(e.get("event") == "log" for e in ev))
        booting = next(e for e in got if e.get("event") == "log")
        assert booting["data"]["data"] == "booting\n" and booting["id"] == str(
            booting["data"]["id"]
        )

        # A chunk posted after the stream opened arrives on it, and on a GraphQL subscription
        # opened without a cursor (which starts with the newest output).
        sub = Socket(api, key)
        sub.subscribe(
            "subscription($wid: ID!) { workloadLogs(workloadId: $wid) "
            "{ id workloadId attempt replica offset data at } }",
            wid=wid,
        )
        tail = sub.items(lambda got: len(got) >= 1, timeout=20)
        assert [t["data"] for t in tail] == ["booting\n"] and tail[0]["workloadId"] == wid
        _post(c, second_node, _lines(wid, ["rank 1 up\n"], replica=1))
        got = _events(lines, lambda ev: any(e.get("data", {}).get("replica") == 1 for e in ev))
        up = [e for e in got if e.get("event") == "log"][-1]
        assert up["data"]["data"] == "rank 1 up\n" and int(up["id"]) > int(booting["id"])
        live = sub.items(lambda got: len(got) >= 1, timeout=20)
        assert live[0]["data"] == "rank 1 up\n" and live[0]["id"] == up["id"]
        # Another tenant's workload: refused with REST's code.
        other = Socket(api, world.key(world.tenant("globex")))
        other.subscribe(
            "subscription($wid: ID!) { workloadLogs(workloadId: $wid) { id } }", wid=wid
        )
        assert other.refusal()["extensions"]["code"] == "workload_not_found"
        other.close()
        sub.close()
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)

    # Resuming with Last-Event-ID repeats nothing; once the workload has ended and gone quiet,
    # the stream says so and closes.
    assert c.delete(f"/v1/workloads/{wid}", headers=headers).status_code == 200
    wait_until(
        lambda: c.get(f"/v1/workloads/{wid}", headers=headers).json()["state"] == "terminated",
        timeout=20,
    )
    # The last lines an agent sends after the end still count.
    _post(c, first_node, _lines(wid, ["bye\n"], start=8))
    t0 = time.monotonic()
    with c.stream(
        "GET",
        f"/v1/workloads/{wid}/logs",
        params={"follow": "true", "replica": 0},
        headers={**headers, "Last-Event-ID": booting["id"]},
    ) as r:
        got = _events(r.iter_lines(), lambda ev: ev[-1].get("event") == "end", timeout=20)
    logs = [e for e in got if e.get("event") == "log"]
    assert [e["data"]["data"] for e in logs] == ["bye\n"]
    assert got[-1]["data"] == {"state": "terminated"}
    assert 1.5 < time.monotonic() - t0 < 10

    # Bad input to the subscription: refused, never an internal error.
    sub = Socket(api, key)
    sub.subscribe(
        "subscription($wid: ID!) { workloadLogs(workloadId: $wid, replica: -1) { id } }",
        wid=wid,
    )
    assert sub.refusal()["extensions"]["code"] == "invalid_replica"
    sub.close()
