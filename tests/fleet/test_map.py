"""`fleetMap`: the operators' heatmap feed, one character per GPU in rack and node order."""

from __future__ import annotations

from sqlalchemy import text

from app.core.db import session_scope
from tests.fixtures.graphql import codes, gql
from tests.fixtures.world import SMALL_FLEET

MAP = """{ fleetMap { regions models nodes nodeStates nodeModels gpuCounts gpus
  racks { name region kind nodes } mig { gpu layout } legend { code name } } }"""


def test_the_map_lays_out_every_gpu_with_its_state(client, world):
    world.fleet(SMALL_FLEET)
    op = world.key()
    with session_scope() as s:
        s.execute(text("UPDATE gpus SET health = 'quarantined' WHERE index = 2"))
        s.execute(text("UPDATE gpus SET health = 'suspect' WHERE index = 3"))
        s.execute(
            text(
                "UPDATE gpus SET health = 'validating' WHERE index = 1 AND node_id = "
                "(SELECT id FROM nodes WHERE name = 'h100-1')"
            )
        )
        # Three trays out as nodes, their GPUs healthy (issue 45 item 8: a node whose agent
        # went silent was `repairing` on the Health page and idle here).
        for tray, health in ((0, "repairing"), (1, "validating"), (2, "unreachable")):
            s.execute(
                text(
                    "UPDATE nodes SET health = :h WHERE id = (SELECT n.id FROM nodes n "
                    "JOIN racks r ON r.id = n.rack_id WHERE r.name = 'nvl-1' "
                    "ORDER BY n.name OFFSET :i LIMIT 1)"
                ),
                {"h": health, "i": tray},
            )
    m = gql(client, op, MAP)["data"]["fleetMap"]
    assert m["regions"] == ["r1"]
    assert [(r["name"], r["kind"], r["nodes"]) for r in m["racks"]] == [
        ("hgx-1", "hgx", 2),
        ("nvl-1", "nvl72", 18),  # an NVL72 rack: its 18 trays of 4
    ]
    assert len(m["nodes"]) == len(m["nodeStates"]) == len(m["gpuCounts"]) == 20
    assert m["gpuCounts"] == [8, 8] + [4] * 18 and len(m["gpus"]) == 16 + 72
    assert m["nodes"][:2] == ["h100-1", "h100-2"] and m["nodeStates"][:2] == "rc"
    h1, h2 = m["gpus"][:8], m["gpus"][8:16]
    assert h1 == ".AQS...P"  # GPU 7 in MIG mode, nothing held on it; validating is not quarantined
    assert h2 == "KKQSKKKK"  # cordoned: idle GPUs take no work; health still shows
    trays = [m["gpus"][16 + 4 * i : 20 + 4 * i] for i in range(18)]
    # The node's own health, as Health says (GPU 2's own quarantine still shows).
    assert trays[:3] == ["QQQQ", "AAQA", "XXQX"]
    assert all(t[2:4] == "QS" for t in trays[3:])
    assert m["mig"] == [{"gpu": 7, "layout": ""}]
    assert {x["code"] for x in m["legend"]} >= set(m["gpus"])
    assert m["models"][m["nodeModels"][0]] == "H100-80GB"


def test_the_map_is_for_operators_and_can_be_narrowed_to_a_region(client, world):
    world.fleet(SMALL_FLEET)
    tenant = world.key(world.tenant("acme"))
    assert codes(gql(client, tenant, MAP)) == ["platform_scope_required"]
    op = world.key()
    m = gql(client, op, '{ fleetMap(region: "nowhere") { gpus racks { name } } }')
    assert m["data"]["fleetMap"] == {"gpus": "", "racks": []}
    world.fleet("regions: [{name: r2, racks: [{name: nvl-2, kind: nvl72}]}]")
    both = gql(client, op, "{ fleetMap { gpus nodes regions } }")["data"]["fleetMap"]
    r1 = gql(client, op, '{ fleetMap(region: "r1") { gpus nodes regions } }')["data"]["fleetMap"]
    assert both["regions"] == ["r1", "r2"] and r1["regions"] == ["r1"]
    assert len(both["gpus"]) == 16 + 72 + 72 and both["gpus"].startswith(r1["gpus"])
    assert r1["nodes"] == both["nodes"][: len(r1["nodes"])] and len(r1["nodes"]) == 20
