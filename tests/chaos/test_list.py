"""`GET /v1/admin/chaos/experiments`: every experiment's id and state, paginated like the other
admin lists (an experiment's id was otherwise seen once, in the reply that started it)."""

from __future__ import annotations

from tests.fixtures.world import SMALL_FLEET, auth

URL = "/v1/admin/chaos/experiments"


def _start(client, op, gpu: int) -> dict:
    # Xid 13, an application error: nothing leaves the pool.
    r = client.post(
        URL,
        json={
            "name": f"app error on GPU {gpu}",
            "faults": [{"kind": "xid", "code": 13, "target": {"node": "h100-1", "gpu": gpu}}],
            "blast_radius": {"max_gpus": 1, "max_region_share": 1},
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    return r.json()


def test_experiments_are_listed_oldest_first_a_page_at_a_time(client, world):
    world.fleet(SMALL_FLEET)
    op = world.key(None)
    made = [_start(client, op, gpu) for gpu in range(3)]
    stopped = client.post(f"{URL}/{made[1]['id']}/stop", headers=auth(op))
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped"

    first = client.get(URL, params={"limit": 2}, headers=auth(op))
    assert first.status_code == 200, first.text
    assert first.json()["next_cursor"]
    rest = client.get(
        URL, params={"limit": 2, "cursor": first.json()["next_cursor"]}, headers=auth(op)
    ).json()
    assert rest["next_cursor"] is None
    items = first.json()["items"] + rest["items"]
    assert [i["id"] for i in items] == [m["id"] for m in made]
    assert [i["state"] for i in items] == ["running", "stopped", "running"]
    assert items[0]["name"] == "app error on GPU 0" and items[0]["gpus_touched"] == 1
    assert "report" not in items[0]  # the report is GET .../{id}'s

    only = client.get(URL, params={"state": "stopped"}, headers=auth(op)).json()["items"]
    assert [i["id"] for i in only] == [made[1]["id"]]
    bad = client.get(URL, params={"state": "paused"}, headers=auth(op))
    assert bad.status_code == 422


def test_only_operators_list_experiments(client, world):
    key = world.key(world.tenant("acme"))
    assert client.get(URL, headers=auth(key)).status_code == 403
    assert client.get(URL).status_code == 401
