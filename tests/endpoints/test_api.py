"""Endpoints' records (issue 47 §1): REST on PostgreSQL. An endpoint's replicas are workloads
submitted by the same path as POST /v1/workloads; its bounds clip its target and the replicas
follow in the same transaction; another tenant sees none of it."""

from __future__ import annotations

from tests.fixtures.world import CORDONED_H100, auth

CHAT = {
    "name": "chat",
    "replica": {"gpus": 1, "command": ["python3", "serve.py"], "env": {"MODEL": "m"}},
    "min_replicas": 1,
    "max_replicas": 3,
    "slo": {"p95_ms": 800},
    "scaling": {"signal": "concurrency", "target": 4},
}


def test_an_endpoint_keeps_its_replicas_at_its_target(client, world):
    world.fleet(CORDONED_H100)
    acme = world.tenant("acme")
    key = world.key(acme)
    other = world.key(world.tenant("beta"))
    op = world.key()

    made = client.post("/v1/endpoints", json=CHAT, headers=auth(key))
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["url_path"] == "/e/chat/" and body["target"] == 1
    assert body["priority"] == "production" and body["ready_path"] == "/healthz"
    assert body["slo"] == {"p95_ms": 800, "ttft_ms": None}
    [replica] = body["replicas"]
    assert replica["state"] == "queued" and replica["ready"] is False
    # The replica is a workload of the tenant's, like any other.
    w = client.get(f"/v1/workloads/{replica['workload_id']}", headers=auth(key)).json()
    assert w["kind"] == "instance" and w["priority"] == "production"
    assert w["labels"] == {"endpoint": "chat"} and w["name"] == "chat-1"
    assert w["command"] == ["python3", "serve.py"] and w["env"] == {"MODEL": "m"}

    again = client.post("/v1/endpoints", json=CHAT, headers=auth(key))
    assert again.status_code == 409 and again.json()["code"] == "endpoint_exists"

    # Raising the floor raises the target at once; lowering the ceiling lets replicas go.
    up = client.patch("/v1/endpoints/chat", json={"min_replicas": 3}, headers=auth(key))
    assert up.status_code == 200, up.text
    assert up.json()["target"] == 3 and len(up.json()["replicas"]) == 3
    down = client.patch(
        "/v1/endpoints/chat", json={"min_replicas": 0, "max_replicas": 2}, headers=auth(key)
    )
    assert down.json()["target"] == 2 and len(down.json()["replicas"]) == 2
    assert [r["name"] for r in down.json()["replicas"]] == ["chat-1", "chat-2"]
    events = client.get("/v1/endpoints/chat/events", headers=auth(key)).json()
    assert [e["kind"] for e in events] == ["updated", "updated", "created"]
    assert events[0]["inputs"]["max_replicas"] == 2 and events[0]["target"] == 2

    bad = client.patch("/v1/endpoints/chat", json={"min_replicas": 5}, headers=auth(key))
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"

    # Another tenant's: not there; an operator's key is not a tenant's.
    assert client.get("/v1/endpoints/chat", headers=auth(other)).status_code == 404
    assert client.get("/v1/endpoints", headers=auth(other)).json()["items"] == []
    assert client.delete("/v1/endpoints/chat", headers=auth(other)).status_code == 404
    assert client.get("/v1/endpoints", headers=auth(op)).status_code == 403

    listed = client.get("/v1/endpoints", headers=auth(key)).json()["items"]
    assert [e["name"] for e in listed] == ["chat"]
    ids = [r["workload_id"] for r in listed[0]["replicas"]]
    assert client.delete("/v1/endpoints/chat", headers=auth(key)).status_code == 204
    assert client.get("/v1/endpoints/chat", headers=auth(key)).status_code == 404
    for wid in ids:  # terminated, and still there for the bill
        assert client.get(f"/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "terminated"


def test_bad_endpoints_are_refused_with_the_field_and_nothing_written(client, world):
    world.fleet(CORDONED_H100)
    key = world.key(world.tenant("acme"))
    cases = [
        ({**CHAT, "min_replicas": 4}, "validation_error"),
        ({**CHAT, "slo": {"p95_ms": 100, "ttft_ms": 50}}, "validation_error"),
        ({**CHAT, "slo": {}}, "validation_error"),
        ({**CHAT, "name": "no spaces"}, "validation_error"),
        ({**CHAT, "replica": {"gpus": 1, "mig_profile": "1g.10gb"}}, "invalid_replica"),
        ({**CHAT, "replica": {"gpus": 1, "runtime": "podman"}}, "invalid_replica"),
        ({**CHAT, "replica": {"gpus": 1, "secret_env": {"T": "nope"}}}, "unknown_secret"),
        ({**CHAT, "replica": {"gpus": 99}}, "validation_error"),
        ({**CHAT, "replica": {"gpus": 8, "gpu_models": ["A100-40GB"]}}, None),
    ]
    for body, code in cases:
        r = client.post("/v1/endpoints", json=body, headers=auth(key))
        assert r.status_code == 422, (body, r.text)
        if code:
            assert r.json()["code"] == code, (body, r.text)
    assert client.get("/v1/endpoints", headers=auth(key)).json()["items"] == []
    assert client.get("/v1/workloads", headers=auth(key)).json()["items"] == []
