"""Operators' hands on GPU health: quarantine, release, retire (API), the history, and what
`GET /v1/admin/health` and `rackplane fleet health` show."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.fixtures.harness import ROOT
from tests.fixtures.health import health, history
from tests.fixtures.workloads import fleet
from tests.fixtures.world import auth


def _ids(client, op):
    nodes = {
        n["name"]: n["id"] for n in client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]
    }
    gpus = client.get("/v1/admin/gpus", params={"node_id": nodes["h1"]}, headers=auth(op)).json()
    return nodes, {g["index"]: g["id"] for g in gpus["items"]}


def test_quarantine_release_retire_by_hand_with_history(client, world, session):
    world.fleet(fleet(2))
    op = world.key(None)
    nodes, gpus = _ids(client, op)
    r = client.post(
        f"/v1/admin/gpus/{gpus[4]}/health",
        json={"action": "quarantine", "reason": "fan noise"},
        headers=auth(op),
    )
    assert r.status_code == 200 and r.json()["health"] == "quarantined"
    # Quarantined twice is still quarantined; release returns it.
    assert (
        client.post(
            f"/v1/admin/gpus/{gpus[4]}/health", json={"action": "quarantine"}, headers=auth(op)
        ).json()["health"]
        == "quarantined"
    )
    r = client.post(
        f"/v1/admin/gpus/{gpus[4]}/health", json={"action": "release"}, headers=auth(op)
    )
    assert r.json()["health"] == "healthy"
    # Retire: out of service; a release then goes through validation.
    r = client.post(f"/v1/admin/gpus/{gpus[5]}/health", json={"action": "retire"}, headers=auth(op))
    assert r.json()["health"] == "out_of_service"
    r = client.post(
        f"/v1/admin/gpus/{gpus[5]}/health", json={"action": "release"}, headers=auth(op)
    )
    assert r.json()["health"] == "validating"
    hist = client.get(
        f"/v1/admin/nodes/{nodes['h1']}/health-events", params={"gpu_index": 4}, headers=auth(op)
    ).json()["items"]
    assert [e["to_state"] for e in hist] == ["healthy", "quarantined"]  # newest first
    assert hist[1]["actor"] == "operator" and "fan noise" in hist[1]["cause"]
    # A whole node, and a move the table refuses.
    r = client.post(
        f"/v1/admin/nodes/{nodes['h2']}/health", json={"action": "retire"}, headers=auth(op)
    )
    assert r.json()["health"] == "out_of_service" and health(session, "h2") == "out_of_service"
    r = client.post(
        f"/v1/admin/nodes/{nodes['h2']}/health", json={"action": "quarantine"}, headers=auth(op)
    )
    assert r.status_code == 409 and r.json()["code"] == "invalid_health_transition"
    r = client.post(f"/v1/admin/gpus/{gpus[4]}/health", json={"action": "fix"}, headers=auth(op))
    assert r.status_code == 422
    r = client.post("/v1/admin/gpus/nope/health", json={"action": "release"}, headers=auth(op))
    assert r.status_code == 404
    assert history(session, "h2") == ["out_of_service"]


def test_the_fleet_health_view_says_what_is_out_and_why(client, world):
    world.fleet(fleet(2))
    op = world.key(None)
    _nodes, gpus = _ids(client, op)
    client.post(
        f"/v1/admin/gpus/{gpus[1]}/health",
        json={"action": "retire", "reason": "RMA 42"},
        headers=auth(op),
    )
    view = client.get("/v1/admin/health", headers=auth(op)).json()
    [region] = view["regions"]
    assert region["gpus"] == 16 and region["by_health"] == {"healthy": 15, "out_of_service": 1}
    assert region["by_allocation"] == {"allocated": 0, "idle": 15, "unavailable": 1}
    [out] = region["racks"][0]["out"]
    assert (out["node"], out["gpu_index"], out["health"]) == ("h1", 1, "out_of_service")
    assert "RMA 42" in out["reason"]
    cli = subprocess.run(
        [sys.executable, "-m", "app.cli", "fleet", "health", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(cli.stdout)["regions"] == view["regions"]
    table = subprocess.run(
        [sys.executable, "-m", "app.cli", "fleet", "health"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    assert "RMA 42" in table.stdout and "out_of_service" in table.stdout


def test_the_cli_quarantines_releases_retires_and_shows_history(world, session):
    world.fleet(fleet(1))

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "app.cli", "fleet", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "COLUMNS": "200"},
        )

    r = cli("quarantine", "h1", "--gpu", "2", "--reason", "ECC storm")
    assert r.returncode == 0 and "GPU 2 of h1: quarantined" in r.stdout
    assert health(session, "h1", 2) == "quarantined"
    assert cli("release", "h1", "--gpu", "2").stdout.strip() == "GPU 2 of h1: healthy"
    assert cli("retire", "h1").stdout.strip() == "h1: out_of_service"
    r = cli("quarantine", "h1")
    assert r.returncode == 2 and "cannot become quarantined" in r.stderr
    assert cli("quarantine", "nope").returncode == 2
    hist = cli("history", "h1").stdout
    assert "ECC storm" in hist and "out_of_service" in hist
