from __future__ import annotations

import json

from app.cli import ROOT


def test_openapi_file_matches_running_app(client):
    """openapi/openapi.json is generated from the app (`make openapi`); fail when they drift."""
    served = client.get("/openapi.json")
    assert served.status_code == 200
    committed = json.loads((ROOT / "openapi" / "openapi.json").read_text())
    assert served.json() == committed, "openapi/openapi.json is stale: run `make openapi`"


def test_every_operation_documents_problem_responses(client):
    spec = client.get("/openapi.json").json()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert "default" in op["responses"], f"{method.upper()} {path} lacks a problem response"
            if op.get("security"):
                assert {"401", "403"} <= set(op["responses"]), f"{method.upper()} {path}"
