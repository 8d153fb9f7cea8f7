from __future__ import annotations

import json

from tests.fixtures.world import SMALL_FLEET, auth, wait_until

BAD_FLEET = """regions:
  - name: r1
    racks:
      - name: hgx-1
        kind: hgx
        gpu_model: H100-80GB
        nodes:
          - {name: n1}
          - {name: n1}
          - name: n2
            gpu_model: GB200
          - name: n3
            mig_gpus: [8]
      - name: nvl-1
        kind: nvl72
        nodes:
          - {name: tray-1}
"""


def _yaml(key: str) -> dict:
    return {**auth(key), "content-type": "application/yaml"}


def test_invalid_fleet_file_names_lines_and_writes_nothing(client, world, session):
    from sqlalchemy import func, select

    from app.models.fleet import FleetImport, Node, Region

    op = world.key(None)
    r = client.post("/v1/admin/fleet:import", headers=_yaml(op), content=BAD_FLEET)
    assert r.status_code == 422
    problem = r.json()
    assert problem["code"] == "invalid_fleet_file"
    by_field = {e["field"]: e for e in problem["errors"]}
    assert by_field["regions[0].racks[0].nodes[1].name"]["line"] == 9
    assert by_field["regions[0].racks[0].nodes[2].gpu_model"]["line"] == 11
    assert by_field["regions[0].racks[0].nodes[3].mig_gpus"]["line"] == 13
    assert by_field["regions[0].racks[1].nodes"]["line"] == 16
    for model in (Region, Node, FleetImport):
        assert session.scalar(select(func.count()).select_from(model)) == 0


def test_schema_errors_and_unknown_fields_are_located(client, world):
    op = world.key(None)
    doc = {"regions": [{"name": "r1", "racks": [{"name": "a", "kind": "dgx", "extra": 1}]}]}
    r = client.post("/v1/admin/fleet:import", headers=auth(op), content=json.dumps(doc, indent=2))
    assert r.status_code == 422
    fields = {e["field"]: e["line"] for e in r.json()["errors"]}
    assert fields["regions[0].racks[0].kind"] == 8
    assert fields["regions[0].racks[0].extra"] == 9
    broken = client.post(
        "/v1/admin/fleet:import", headers=_yaml(op), content="regions: [\n  - {name: "
    )
    assert broken.status_code == 422 and broken.json()["errors"][0]["line"] is not None


def test_dry_run_validates_without_writing(client, world, session):
    from sqlalchemy import func, select

    from app.models.fleet import Gpu

    r = client.post(
        "/v1/admin/fleet:import",
        headers=_yaml(world.key(None)),
        content=SMALL_FLEET,
        params={"dry_run": True},
    )
    assert r.status_code == 200
    assert r.json() == {
        "valid": True,
        "totals": {"regions": 1, "racks": 2, "nodes": 20, "gpus": 88},
    }
    assert session.scalar(select(func.count()).select_from(Gpu)) == 0


def test_import_runs_on_a_real_worker_and_is_visible_through_the_api(
    client, world, celery_worker_process
):
    op = world.key(None)
    r = client.post(
        "/v1/admin/fleet:import",
        headers=_yaml(op),
        content=SMALL_FLEET,
        params={"source": "small.yaml"},
    )
    assert r.status_code == 202, r.text
    assert r.headers["location"] == f"/v1/admin/fleet/imports/{r.json()['id']}"

    def done():
        body = client.get(r.headers["location"], headers=auth(op)).json()
        return body if body["status"] in ("succeeded", "failed") else None

    result = wait_until(done, timeout=60)
    assert result["status"] == "succeeded", result
    assert result["summary"]["created_gpus"] == 88
    nodes = client.get("/v1/admin/nodes", headers=auth(op), params={"limit": 100}).json()["items"]
    assert len(nodes) == 20
    trays = [n for n in nodes if n["name"].startswith("nvl-1-tray")]
    assert len(trays) == 18 and {n["nvlink_domain"] for n in trays} == {"r1/nvl-1"}
    h100 = next(n for n in nodes if n["name"] == "h100-1")
    assert h100["nvlink_domain"] == "r1/hgx-1/h100-1"
    detail = client.get(f"/v1/admin/nodes/{h100['id']}", headers=auth(op)).json()
    assert [g["index"] for g in detail["gpus"]] == list(range(8))
    assert [g["mig_mode"] for g in detail["gpus"]] == [False] * 7 + [True]
    # The tenant's view: 72 GB200 free; H100: 16 total, 7 free (one MIG GPU, one cordoned node).
    t = world.tenant("acme")
    cap = client.get("/v1/capacity", headers=auth(world.key(t))).json()["items"]
    assert {(c["gpu_model"], c["total_gpus"], c["free_gpus"]) for c in cap} == {
        ("GB200", 72, 72),
        ("H100-80GB", 16, 7),
    }
    # Importing the same file again is a no-op.
    again = client.post("/v1/admin/fleet:import", headers=_yaml(op), content=SMALL_FLEET)
    r2 = wait_until(
        lambda: (
            (b := client.get(again.headers["location"], headers=auth(op)).json())["status"]
            == "succeeded"
            and b
        )
    )
    assert r2["summary"]["created_gpus"] == 0 and r2["summary"]["created_nodes"] == 0


def test_a_conflicting_import_is_refused_whole_dry_run_or_not(client, world, session):
    """A dry run checks the file against the fleet as it is (the README's file once said
    `valid` and then failed on a node of another rack); every conflict is named at its field."""
    from sqlalchemy import func, select

    from app.core.errors import AppError
    from app.fleet import document
    from app.fleet.service import apply_document
    from app.models.fleet import FleetImport, Node

    world.fleet(SMALL_FLEET)
    before = session.scalar(select(func.count()).select_from(Node))
    conflicting = """
regions:
  - name: r1
    racks:
      - {name: nvl-2, kind: nvl72}
      - name: nvl-1
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: fresh-1}]
      - name: hgx-9
        kind: hgx
        gpu_model: H100-80GB
        nodes: [{name: h100-1}]
"""
    op = world.key(None)
    for params in ({"dry_run": True}, {}):
        r = client.post(
            "/v1/admin/fleet:import", headers=_yaml(op), content=conflicting, params=params
        )
        assert r.status_code == 409, r.text
        problem = r.json()
        assert problem["code"] == "fleet_conflict"
        by_field = {e["field"]: e["message"] for e in problem["errors"]}
        assert "exists as nvl72" in by_field["regions[0].racks[1].kind"]
        assert "already exists in rack r1/" in by_field["regions[0].racks[2].nodes[0].name"]
    assert session.scalar(select(func.count()).select_from(Node)) == before
    assert session.scalar(select(func.count()).select_from(FleetImport)) == 0
    # The worker asks the same question when it applies (the fleet may have changed since).
    try:
        apply_document(session, document.load(conflicting))
        raise AssertionError("applied a conflicting file")
    except AppError as e:
        assert e.code == "fleet_conflict" and len(e.extra["errors"]) == 2
    session.rollback()


def test_a_racks_bad_gpu_model_is_named_at_its_field(client, world):
    bad = "regions:\n  - name: r1\n    racks:\n      - name: h\n        kind: hgx\n"
    bad += "        gpu_model: H100-80G\n        nodes: [{name: a}, {name: b}]\n"
    r = client.post("/v1/admin/fleet:import", headers=_yaml(world.key(None)), content=bad)
    assert r.status_code == 422
    [error] = r.json()["errors"]  # once, at the field: not once per node, not at the rack
    assert (error["field"], error["line"]) == ("regions[0].racks[0].gpu_model", 6)


def test_node_state_transitions(client, world, session):
    from sqlalchemy import select

    from app.models.fleet import Node

    world.fleet(SMALL_FLEET)
    op = world.key(None)
    node = session.scalar(select(Node).where(Node.name == "h100-1"))
    url = f"/v1/admin/nodes/{node.id}"
    r = client.patch(url, headers=auth(op), json={"state": "cordoned", "reason": "maintenance"})
    assert r.status_code == 200 and r.json()["state"] == "cordoned"
    assert r.json()["generation"] == 1
    assert (
        client.patch(url, headers=auth(op), json={"state": "draining"}).json()["state"]
        == "draining"
    )
    assert client.patch(url, headers=auth(op), json={"state": "down"}).status_code == 200
    bad = client.patch(url, headers=auth(op), json={"state": "draining"})
    assert bad.status_code == 409 and bad.json()["code"] == "invalid_state_transition"
    wrong = client.patch(url, headers=auth(op), json={"state": "exploded"})
    assert wrong.status_code == 422 and wrong.json()["errors"][0]["field"] == "body.state"
    missing = client.patch("/v1/admin/nodes/not-a-uuid", headers=auth(op), json={"state": "ready"})
    assert missing.status_code == 404 and missing.json()["code"] == "node_not_found"


def test_gpu_listing_paginates_over_the_whole_fleet(client, world):
    world.fleet(SMALL_FLEET)
    op = world.key(None)
    ids, cursor = set(), None
    while True:
        page = client.get(
            "/v1/admin/gpus",
            headers=auth(op),
            params={"limit": 25, **({"cursor": cursor} if cursor else {})},
        ).json()
        ids |= {g["id"] for g in page["items"]}
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(ids) == 88


def test_cli_import_reports_lines_and_applies(tmp_path, session):
    import subprocess
    import sys

    from sqlalchemy import func, select

    from app.models.fleet import Gpu

    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_FLEET)
    r = subprocess.run(
        [sys.executable, "-m", "app.cli", "fleet", "import", str(bad)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert f"{bad}:11" in r.stderr.replace("\n", "") or f"{bad}:11" in r.stderr
    good = tmp_path / "good.yaml"
    good.write_text(SMALL_FLEET)
    r = subprocess.run(
        [sys.executable, "-m", "app.cli", "fleet", "import", str(good)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["created_gpus"] == 88
    assert session.scalar(select(func.count()).select_from(Gpu)) == 88


def test_the_readmes_fleet_file_imports_beside_the_demo_fleet(client, world):
    import re

    from tests.fixtures.harness import ROOT

    readme = (ROOT / "README.md").read_text().split("## Fleet files", 1)[1]
    example = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)
    world.fleet((ROOT / "app" / "fleet" / "demo_fleet.yaml").read_text())
    op = world.key(None)
    dry = client.post(
        "/v1/admin/fleet:import", headers=_yaml(op), content=example, params={"dry_run": True}
    )
    assert dry.status_code == 200 and dry.json()["valid"], dry.text
    assert (
        client.post("/v1/admin/fleet:import", headers=_yaml(op), content=example).status_code == 202
    )


def test_the_clis_dry_run_checks_against_the_fleet_too(world, tmp_path):
    from typer.testing import CliRunner

    from app.cli import cli

    world.fleet(SMALL_FLEET)
    clash = tmp_path / "clash.yaml"
    clash.write_text(
        "regions:\n  - name: r1\n    racks:\n      - name: hgx-9\n        kind: hgx\n"
        "        gpu_model: H100-80GB\n        nodes: [{name: h100-1}]\n"
    )
    out = CliRunner().invoke(cli, ["fleet", "import", str(clash), "--dry-run"])
    assert out.exit_code == 2, out.output
    assert "regions[0].racks[0].nodes[0].name" in out.output and "valid" not in out.output
    # A valid one: JSON, as the import prints and as REST answers (it was a Python dict).
    fine = tmp_path / "fine.yaml"
    fine.write_text(clash.read_text().replace("h100-1", "h100-9"))
    out = CliRunner().invoke(cli, ["fleet", "import", str(fine), "--dry-run"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {
        "valid": True,
        "totals": {"regions": 1, "racks": 1, "nodes": 1, "gpus": 8},
    }


def test_pcie_racks_hold_one_to_ten_gpus_of_pcie_models(client, world):
    """Issue 45 item 11: a 1-GPU host (the real H200) was refused: `hgx nodes have 8 or 4
    GPUs; got 1`."""
    op = world.key(None)
    doc = """regions:
  - name: r1
    racks:
      - name: pcie-1
        kind: pcie
        gpu_model: L4-24GB
        nodes:
          - {name: one, gpu_model: H200-141GB, gpus: 1}
          - {name: ten, gpus: 10}
          - {name: nvl, gpu_model: H100-PCIe-80GB, gpus: 2, mig_gpus: [1], agent: true}
          - {name: eleven, gpus: 11}
          - {name: tray, gpu_model: GB200, gpus: 4}
"""
    r = client.post("/v1/admin/fleet:import", headers=_yaml(op), content=doc)
    assert r.status_code == 422
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert errors == {
        "regions[0].racks[0].nodes[3].gpus": "pcie nodes have 1 to 10 GPUs; got 11",
        "regions[0].racks[0].nodes[4].gpu_model": "GB200 is not sold in pcie racks",
    }, errors
    good = "\n".join(doc.splitlines()[:-2]) + "\n"
    r = client.post("/v1/admin/fleet:import", headers=_yaml(op), content=good)
    assert r.status_code in (200, 201, 202), r.text


def test_the_readmes_mig_try_it_node_imports_beside_the_local_node(client, world):
    """Issue 45 item 16: the README's path to try a MIG layout without a GPU imports
    examples/mig-0.yaml into region `local` beside local-0."""
    from tests.fixtures.harness import ROOT

    op = world.key(None)
    world.fleet((ROOT / "app" / "fleet" / "local_node.yaml").read_text())
    world.fleet((ROOT / "examples" / "mig-0.yaml").read_text())
    nodes = {n["name"]: n for n in client.get("/v1/admin/nodes", headers=auth(op)).json()["items"]}
    assert nodes["mig-0"]["health"] == "validating"  # until its agent joins and burns in
