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

from tests.fixtures.harness import ROOT
from tests.fixtures.world import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _output(base: str, headers: dict, wid: str) -> str:
    r = httpx.get(f"{base}/v1/workloads/{wid}/logs", headers=headers)
    return "".join(c["data"] for c in r.json()["items"]) if r.status_code == 200 else ""


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
        # The demo fleet's 152 GPUs and the local node's 4 (examples/local-0.yaml).
        assert sum(c["total_gpus"] for c in cap["items"]) == 156
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
        assert sum(c["total_gpus"] for c in cap["items"]) == 228
        # The local node's agent runs real processes: examples/train.py on its made-up GPUs,
        # its output read back, its checkpoint reported with the run's own token.
        assert "node agent local-0" in log()
        job = httpx.post(
            f"{base}/v1/workloads",
            headers=th,
            json={
                "kind": "instance",
                "gpus": 2,
                "region": "local",
                "command": [
                    sys.executable,
                    str(ROOT / "examples" / "train.py"),
                    "--steps",
                    "6",
                    "--step-seconds",
                    "0.2",
                    "--checkpoint-every",
                    "3",
                    "--checkpoint-dir",
                    str(tmp_path / "ckpt"),
                ],
            },
        )
        assert job.status_code == 201, job.text
        wid = job.json()["id"]
        done = wait_until(
            lambda: (
                (w := httpx.get(f"{base}/v1/workloads/{wid}", headers=th).json())["state"]
                in ("succeeded", "failed")
                and w
            ),
            timeout=120,
            interval=1,
        )
        assert done["state"] == "succeeded", (done, log())
        assert done["last_checkpoint_step"] == 6 and done["last_checkpoint_uri"].startswith("file:")
        output = wait_until(
            lambda: "step 6/6" in (o := _output(base, th, wid)) and o, timeout=30, interval=1
        )
        assert re.search(r"devices=GPU-10ca1000-\S+,GPU-10ca1000-", output), output
        # The README's walkthrough: the node dies (agent and processes, SIGKILL) and its agent
        # is started again by hand; the job resumes from its last checkpoint and succeeds.
        ckpt = tmp_path / "ckpt2"
        job = httpx.post(
            f"{base}/v1/workloads",
            headers=th,
            json={
                "kind": "job",
                "gpus": 2,
                "replicas": 2,
                "region": "local",
                "command": [sys.executable, str(ROOT / "examples" / "train.py"), "--steps", "40"]
                + [
                    "--step-seconds",
                    "0.2",
                    "--checkpoint-every",
                    "5",
                    "--checkpoint-dir",
                    str(ckpt),
                ],
            },
        )
        wid = job.json()["id"]
        w = lambda: httpx.get(f"{base}/v1/workloads/{wid}", headers=th).json()  # noqa: E731
        wait_until(lambda: (w()["last_checkpoint_step"] or 0) >= 10, timeout=60, interval=0.5)
        state_dir = tmp_path / "data" / "agent" / "local-0"
        # A power cut, as the README makes one: the agent of this state directory, its runs'
        # shims (which would record the kill as the job's exit) and the jobs, nothing else.
        cut = subprocess.run(
            [sys.executable, "-m", "app.cli", "agent", "stop", "--state-dir", str(state_dir)]
            + ["--power-cut"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert cut.returncode == 0 and "killed 2 run(s)" in cut.stdout, cut.stdout + cut.stderr
        again = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "agent", "--api", base, "--state-dir", str(state_dir)]
            + ["--inventory", str(ROOT / "examples" / "local-0.yaml"), "--address", "127.0.0.1"]
            + ["--same-user"],  # as `rackplane up` starts it (README)
            cwd=ROOT,
            env=env,
            stdout=open(tmp_path / "agent2.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            done = wait_until(
                lambda: (x := w())["state"] in ("succeeded", "failed") and x, timeout=90
            )
        finally:
            again.kill()
            again.wait(timeout=10)
        assert done["state"] == "succeeded" and done["attempts"] == 2, done
        events = httpx.get(f"{base}/v1/workloads/{wid}/events", headers=th).json()["items"]
        requeue = next(
            e for e in events if (e["from_state"], e["to_state"]) == ("preempted", "queued")
        )
        step = requeue["details"]["checkpoint_step"]
        assert step >= 10 and "process was lost" in events[events.index(requeue) - 1]["reason"]
        assert f"resumed from step {step}" in _output(base, th, wid)
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
        agent = f"--state-dir {tmp_path / 'data' / 'agent'}"
        stray = subprocess.run(["pgrep", "-f", "--", agent], capture_output=True, text=True).stdout
        if stray.strip():
            subprocess.run(["pkill", "-9", "-f", "--", agent])
        assert not stray.strip(), f"the local agent was left behind: {stray}"
        # Its stop answered the local agent's long poll rather than cancel it (a 500 where an
        # answer was due): no error in the API's log, nor on the console.
        logs = tmp_path / "data" / "logs"
        api_log = (logs / "api.log").read_text()
        for where in (api_log, log()):
            assert "Exception in ASGI application" not in where, where[-4000:]
        # The console is for people: the worker's lines go to its log file (issue 45 item 16:
        # a JSON line per Celery task scrolled the keys away).
        assert "[queues]" in (logs / "worker.log").read_text() and "[queues]" not in log()
        assert f"logs       {logs / 'api.log'}" in log()
    # Started again on the same data: the keys are not shown again (only hashes are kept), so
    # the banner says how to make one, and that command works.
    restart = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "up",
            "--no-worker",
            "--no-agent",
            "--port",
            str(_free_port()),
        ],
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
