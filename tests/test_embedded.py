"""`rackplane up` on its embedded default: SQLite database, SQLite broker, real worker process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.conftest import ROOT, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rackplane_up_serves_on_sqlite_with_a_worker(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        {
            "RACKPLANE_DATA_DIR": str(tmp_path / "data"),
            "RACKPLANE_PORT": str(port),
            "RACKPLANE_SEED_DEMO": "true",
            "RACKPLANE_LOG_LEVEL": "WARNING",
        }
    )
    out = open(tmp_path / "up.log", "w+b")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", "--concurrency", "1"],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def log() -> str:
        out.flush()
        return (tmp_path / "up.log").read_text(errors="replace")

    try:

        def healthy():
            if proc.poll() is not None:
                raise AssertionError("rackplane up exited:\n" + log())
            try:
                return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=90, interval=0.5)
        assert (tmp_path / "data" / "rackplane.sqlite").exists()
        docs = httpx.get(f"{base}/docs").text
        assert "Swagger UI" in docs and "cdn." not in docs  # served by the app: works offline
        asset = re.search(r'src="(/[^"]+swagger-ui-bundle\.js)"', docs).group(1)
        assert httpx.get(base + asset).status_code == 200
        assert httpx.get(f"{base}/readyz").json()["status"] == "ready"
        tenant_key = re.search(r"demo tenant key\s+(rp_\w+)", log()).group(1)
        operator_key = re.search(r"operator key\s+(rp_\w+)", log()).group(1)
        cap = httpx.get(
            f"{base}/v1/capacity", headers={"Authorization": f"Bearer {tenant_key}"}
        ).json()
        assert sum(c["total_gpus"] for c in cap["items"]) == 152
        # On SQLite too, every instant read back is UTC with its offset.
        th = {"Authorization": f"Bearer {tenant_key}"}
        made = httpx.post(f"{base}/v1/keys", json={"name": "z"}, headers=th).json()
        again = httpx.get(f"{base}/v1/keys/{made['id']}", headers=th).json()
        assert made["created_at"].endswith("Z") and again["created_at"].endswith("Z")
        # The demo bills: a price book for every model, shape and plan is seeded.
        prices = httpx.get(
            f"{base}/v1/admin/prices",
            params={"limit": 500},
            headers={"Authorization": f"Bearer {operator_key}"},
        ).json()["items"]
        assert len(prices) == 45
        h100 = {
            (p["shape"], p["plan"]): p["unit_amount"]
            for p in prices
            if p["gpu_model"] == "H100-80GB"
        }
        assert h100[("whole", "on_demand")] == 616 and h100[("whole", "preemptible")] == 246
        # The portal: printed, served, and the demo key signs in to see the demo's work, which
        # the worker has placed (a browser session on SQLite: cookie, CSRF, GraphQL).
        assert f"portal     {base}/portal/" in log()
        page = httpx.get(f"{base}/portal/")
        assert (
            page.status_code == 200
            and "default-src 'self'" in page.headers["content-security-policy"]
        )
        with httpx.Client(base_url=base) as browser:
            csrf = browser.post("/v1/sessions", json={"api_key": tenant_key}).json()["csrf_token"]
            q = "{ workloads(first: 20, active: true) { edges { node { name state } } } }"

            def demo_running():
                data = browser.post(
                    "/graphql", json={"query": q}, headers={"X-CSRF-Token": csrf}
                ).json()["data"]
                states = {e["node"]["name"]: e["node"]["state"] for e in data["workloads"]["edges"]}
                return states if states.get("llm-pretrain") == "running" else None

            states = wait_until(demo_running, timeout=60, interval=1)
        assert states["eval-h200"] == "queued" and len(states) == 6, states
        # The try-line is printed whole, so it can be pasted.
        assert re.search(r"try: curl -H 'Authorization: Bearer rp_\w+' http\S+/v1/capacity", log())
        # A fleet import goes through the embedded broker to the worker process and back.
        r = httpx.post(
            f"{base}/v1/admin/fleet:import",
            headers={"Authorization": f"Bearer {operator_key}", "content-type": "application/yaml"},
            content="regions: [{name: extra, racks: [{name: nvl-x, kind: nvl72}]}]",
        )
        assert r.status_code == 202, r.text
        status = wait_until(
            lambda: (
                (
                    s := httpx.get(
                        base + r.headers["location"],
                        headers={"Authorization": f"Bearer {operator_key}"},
                    ).json()["status"]
                )
                in ("succeeded", "failed")
                and s
            ),
            timeout=60,
        )
        assert status == "succeeded", log()
        cap = httpx.get(
            f"{base}/v1/capacity", headers={"Authorization": f"Bearer {tenant_key}"}
        ).json()
        assert sum(c["total_gpus"] for c in cap["items"]) == 224
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            # A clean stop, not a wait for the worker's pool to be killed and restarted
            # (stopping took 22-65 s when the whole group got SIGTERM; about 7 s now).
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        # The worker it started (in its own process group) is gone too.
        time.sleep(1)
        leftovers = subprocess.run(
            ["pgrep", "-f", f"rackplane-{proc.pid}@"], capture_output=True, text=True
        ).stdout.strip()
        if leftovers:
            subprocess.run(["pkill", "-9", "-f", f"rackplane-{proc.pid}@"])
        assert not leftovers, f"worker processes left behind: {leftovers}"
    # Started again on the same data: the keys are not shown again (only hashes are kept), so
    # the banner says how to make one, and that command works.
    restart = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "up", "--no-worker", "--port", str(_free_port())],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        banner = ""
        for line in restart.stdout:
            banner += line
            if "keys create --platform" in line or "demo tenant key" in line:
                break
    finally:
        os.killpg(restart.pid, signal.SIGKILL)
        restart.wait(timeout=10)
    assert "demo tenant key" not in banner and "sign in with an API key" in banner, banner
    command = re.search(r"(\.venv/bin/rackplane keys create --tenant demo[^\n]*)", banner)
    made = subprocess.run(
        command.group(1).split(),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0 and re.search(r"rp_\w{48}", made.stdout), made.stderr
