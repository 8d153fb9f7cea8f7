"""The README's customer walkthrough and its billing section, run as written (the port aside)
against `rackplane up` on the embedded default from this checkout: they produce what the README
says. tests/cli/test_embedded.py covers start-up, the demo keys and stopping."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import httpx

from tests.fixtures.harness import ROOT
from tests.fixtures.world import wait_until


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _walkthrough() -> str:
    return re.search(r"```sh\n(.*?)```", _section("Workloads (customer API)"), re.S).group(1)


def _billing() -> str:
    """The prices, bills and budgets section's commands, in order (both of its blocks)."""
    return "".join(re.findall(r"```sh\n(.*?)```", _section("Prices, bills and budgets"), re.S))


def _endpoints() -> str:
    return re.search(r"```sh\n(.*?)```", _section("Inference endpoints"), re.S).group(1)


def test_the_readme_walkthrough_does_what_it_says(tmp_path):
    from rackplane_bench.deploy import free_port

    assert shutil.which("jq") and shutil.which("curl"), "the walkthrough uses curl and jq"
    port, gateway = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        RACKPLANE_DATA_DIR=str(tmp_path / "data"),
        RACKPLANE_PORT=str(port),
        RACKPLANE_GATEWAY_PORT=str(gateway),
        RACKPLANE_SEED_DEMO="true",
        RACKPLANE_LOG_JSON="true",
    )
    env.pop("RACKPLANE_KEY_PEPPER", None)  # the embedded default generates its own
    env.pop("RACKPLANE_SECRET_KEY", None)
    # As a reader runs it: the default beat and simulated boot, not the suite's quick ones (a
    # one-second budget evaluation and health sweep keep the one embedded worker busy).
    for quick in (
        "RACKPLANE_BUDGET_EVAL_SECONDS",
        "RACKPLANE_HEALTH_SWEEP",
        "RACKPLANE_PLACEMENT_TICK",
        "RACKPLANE_SIM_BOOT_SECONDS",
    ):
        env.pop(quick, None)
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy():
            try:
                return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=90, interval=0.5)
        key = re.search(r"demo tenant key\s+(rp_\w+)", (tmp_path / "up.log").read_text())
        # A reader gets to the walkthrough after the demo's own work has started (the seeded
        # workloads take the worker's first seconds).
        demo_h = {"Authorization": f"Bearer {key.group(1)}"}

        def demo_started() -> bool:
            items = httpx.get(f"{base}/v1/workloads", headers=demo_h).json()["items"]
            return bool(items) and all(w["state"] in ("running", "queued") for w in items)

        wait_until(demo_started, timeout=90, interval=1)
        script = _walkthrough().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = subprocess.run(
            ["bash", "-c", script],
            env={**os.environ, "TENANT_KEY": key.group(1)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        # Split the outputs: the JSON documents and lines the commands printed, in order.
        decoder, docs, rest = json.JSONDecoder(), [], out.stdout.strip()
        while rest:
            doc, end = decoder.raw_decode(rest)
            docs.append(doc)
            rest = rest[end:].strip()
        gang, *events_and_rest = docs
        assert gang["state"] == "running"  # "running in a few seconds"
        assert len(gang["placement"]) == 2 and len({p["node"] for p in gang["placement"]}) == 1
        events = [d for d in events_and_rest if isinstance(d, list)]
        assert [e[0] for e in events][:5] == [
            "pending",
            "queued",
            "placing",
            "provisioning",
            "running",
        ]
        pod = next(d for d in docs if isinstance(d, dict) and d.get("kind") == "Pod")
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"nvidia.com/mig-3g.40gb": "1"}
        dry = next(d for d in docs if isinstance(d, dict) and "placeable_now" in d)
        assert dry["placeable_now"] and dry["placement"]
        assert docs[-1] == "terminated"

        # The billing section, followed in order after the walkthrough, as a reader would:
        # prices, bills, a budget, a commitment; the tenant is not locked out at the end.
        operator = re.search(r"operator key\s+(rp_\w+)", (tmp_path / "up.log").read_text())
        api = f'API=http://127.0.0.1:{port}; H="Authorization: Bearer $TENANT_KEY"\n'
        out = subprocess.run(
            ["bash", "-c", "set -e\n" + api + _billing()],
            env={**os.environ, "TENANT_KEY": key.group(1), "OPERATOR_KEY": operator.group(1)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        decoder, docs, rest = json.JSONDecoder(), [], out.stdout.strip()
        while rest:
            doc, end = decoder.raw_decode(rest)
            docs.append(doc)
            rest = rest[end:].strip()
        price, summary, upcoming, budget_set, budget, commitment, mine, totals, fits = docs
        assert price["unit_amount"] == 249 and summary["period"] == "2026-11"
        assert budget_set["spend_limit"] == 10_000_000
        assert budget["exhausted"] is False and budget["spend_limit"] == 10_000_000
        assert commitment["gpus_milli"] == 2000 and [c["gpus_milli"] for c in mine["items"]] == [
            2000
        ]
        assert 0 < totals["usd"] < budget["spend_limit"]  # the commitment is owed, within budget
        assert fits is True  # not locked out: a dry run still answers where it would go

        # Inference endpoints: one made on the local node serves examples/serve.py from zero,
        # its first call held while the replica starts, and streams the tokens.
        script = _endpoints().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        script = script.replace("127.0.0.1:8001", f"127.0.0.1:{gateway}")
        out = subprocess.run(
            ["bash", "-c", "set -e\n" + script],
            cwd=ROOT,
            env={**os.environ, "TENANT_KEY": key.group(1)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert json.loads(lines[0]) == {"url_path": "/e/chat/", "target": 0}
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and len(data) == 10, lines  # 8 tokens, usage, end
        after = json.loads(next(line for line in lines if line.startswith('{"target"')))
        assert after["target"] == 1 and after["replicas"][0]["ready"] is True
        assert '["scaled","activator",1]' in lines and lines[-1] == "204"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
