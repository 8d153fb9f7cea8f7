"""Schemathesis (pinned in pyproject) hunts the running API on PostgreSQL: every check, positive
and negative data, the stateful phase over the links it infers, once per principal: a tenant
key of each scope, then an operator key. Zero failures is the bar; what is out of scope is in
`schemathesis.toml`, each with its reason. Bounded: about 30 s of generation per principal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.harness import ROOT

SECONDS_PER_PRINCIPAL = int(os.environ.get("RACKPLANE_FUZZ_SECONDS", "30"))
SEED = os.environ.get("RACKPLANE_FUZZ_SEED", "20261125")
ALL = ["shared-timeslice", "shared-fractional", "shared-mig", "dedicated-gpu", "vm"]


@pytest.fixture
def principals(world):
    """A fleet, an active tenant with keys of each scope, and an operator key (the tables are
    emptied before each test)."""
    world.fleet((ROOT / "app" / "fleet" / "demo_fleet.yaml").read_text())
    tenant = world.tenant("fuzz", policy=ALL)
    return {
        "tenant-read": world.key(tenant, scopes=("read",), name="fuzz-read"),
        "tenant-write": world.key(tenant, scopes=("read", "write"), name="fuzz-write"),
        "tenant-admin": world.key(tenant, name="fuzz-admin"),
        "operator": world.key(None, name="fuzz-operator"),
    }


def _run(api: str, key: str, report: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "schemathesis"),
            "run",
            f"{api}/openapi.json",
            "--checks",
            "all",
            "--mode",
            "all",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--workers",
            "1",
            "--max-time",
            str(SECONDS_PER_PRINCIPAL),
            "--seed",
            SEED,
            "--generation-database",
            "none",
            "--header",
            f"Authorization: Bearer {key}",
            "--no-color",
            "--report",
            "junit",
            "--report-junit-path",
            str(report),
        ],
        cwd=ROOT,  # schemathesis.toml
        capture_output=True,
        text=True,
        timeout=SECONDS_PER_PRINCIPAL * 6 + 120,
    )


@pytest.mark.parametrize("who", ["tenant-read", "tenant-write", "tenant-admin", "operator"])
def test_schemathesis_finds_nothing(api, principals, who, tmp_path):
    out = _run(api, principals[who], tmp_path / f"{who}.xml")
    failures = out.stdout.partition("=== FAILURES ===")[2].partition("=== WARNINGS ===")[0]
    said = "\n".join(line[:400] for line in (failures or out.stdout[-6000:]).splitlines())
    assert out.returncode == 0, said + out.stderr[-3000:]
    assert "No issues found" in out.stdout or " passed" in out.stdout, said
