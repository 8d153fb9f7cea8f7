"""`rackplane bench ddp`: what losing a host costs a distributed training job (issue 46).

N hosts made of network namespaces (rackplane_bench/hosts.py), each with its own `rackplane
agent` at its own address, against a scratch deployment (API on the hosts' bridge, a worker
with its beat, PostgreSQL, Redis). A DDP job (`examples/ddp_train.py`, Gloo, one replica of
four GPUs per host, one host left spare) trains; after its first checkpoint the host of its
last rank is lost (every process in it SIGKILLed, its link cut). Measured per run:

- `detect_s`: the loss to the control plane acting on it (the requeue's time, or the elastic
  shrink's: the server's clock, this machine's);
- `resume_s`: the loss to training stepping again (the first step after the resume, stamped
  by rank 0 with the wall clock);
- `steps_lost`: the steps done before the loss that were done again (rank 0's last step before
  the loss minus the checkpoint's step).

Fixed-size gangs are requeued and placed again (on the hosts left and the spare); elastic ones
(`min_replicas` = N - 2) go on at once with the replicas left. The lost host then comes back
(its link, a new agent) and is in service again before the next run (the circuit breaker's
window is 1 s: the bench's losses are one at a time, not a wave). Heartbeat settings: the
agent reports every 2 s and a node is lost after 6 s of silence (RACKPLANE_HEARTBEAT_TIMEOUT=6),
the health sweep every 2 s (RACKPLANE_HEALTH_SWEEP=2)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from rackplane_bench.deploy import ScratchDeployment, pct
from rackplane_bench.hosts import Hosts, available

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / ".venv-train" / "bin" / "python"
DDP = ROOT / "examples" / "ddp_train.py"
HEARTBEAT_TIMEOUT = 6.0
GPUS = 4
STEP_S = 0.2
CHECKPOINT_EVERY = 20

_SEED = """
import json, sys
import app.models
from app.core.db import session_scope
from app.fleet import document
from app.fleet.service import apply_document
from app.keys.service import create_key
from app.tenants.service import create_tenant
with session_scope() as s:
    apply_document(s, document.load(sys.stdin.read()))
    t = create_tenant(s, name="Train", slug="train", contact_email="t@example.com",
                      status="active", isolation_policy=None)
    key = create_key(s, tenant_id=t.id, name="train", scopes=["read", "write"]).key
    op = create_key(s, tenant_id=None, name="operator", scopes=["platform"]).key
    print(json.dumps({"key": key, "operator": op}))
"""


class Unavailable(Exception):
    pass


def unavailable() -> str | None:
    why = available()
    if why:
        return why
    if not TRAIN_PY.exists():
        return "no .venv-train with torch (make train-engines)"
    return None


def _fleet(n: int) -> str:
    nodes = [{"name": f"h{i}", "gpus": GPUS} for i in range(n)]
    doc = {
        "regions": [
            {
                "name": "r1",
                "racks": [{"name": "ddp", "kind": "hgx", "gpu_model": "H100-80GB", "nodes": nodes}],
            }
        ]
    }
    return yaml.safe_dump(doc)


class Cluster:
    """The hosts, their agents and the control plane they report to."""

    def __init__(self, n: int, log: Callable[[str], None]):
        self.n, self.log = n, log
        self.hosts = Hosts.make(n)
        self.dir = Path(tempfile.mkdtemp(prefix="rp-ddp-", dir="/tmp"))
        self.dir.chmod(0o711)  # runs of their own uids reach their work and checkpoints
        self.ckpt = self.dir / "ckpt"
        self.ckpt.mkdir()
        self.ckpt.chmod(0o1777)
        self.agents: dict[int, subprocess.Popen] = {}
        self.dep = ScratchDeployment(
            workers=1,
            env={
                "RACKPLANE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
                "RACKPLANE_HEALTH_SWEEP": "2",
                "RACKPLANE_AGENT_START_TIMEOUT": "90",
                # The operator trusts these hosts with `process` runs (the training job's).
                "RACKPLANE_PROCESS_POOLS": "*",
                # One loss at a time, each repaired before the next: none is part of a wave
                # the circuit breaker should hold back (8 GPUs an hour, by default, here).
                "RACKPLANE_BREAKER_WINDOW": "1",
            },
        )
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import json

        out = subprocess.run(
            [sys.executable, "-c", _SEED],
            cwd=ROOT,
            env=self.dep.env,
            input=_fleet(self.n),
            capture_output=True,
            text=True,
            check=True,
        )
        data = json.loads(out.stdout.strip().splitlines()[-1])
        self.key, self.operator = data["key"], data["operator"]
        self.url = self.dep.start(api_processes=1, host=self.hosts.gateway)
        self.http = httpx.Client(base_url=self.url, timeout=15)
        nodes = self.op_get("/v1/admin/nodes")["items"]
        self.node_ids = {n["name"]: n["id"] for n in nodes}
        for i in range(self.n):
            self.start_agent(i, join=True)
        self.wait_ready()

    def op_get(self, path: str) -> Any:
        r = self.http.get(path, headers={"Authorization": f"Bearer {self.operator}"})
        r.raise_for_status()
        return r.json()

    def start_agent(self, i: int, join: bool = False) -> None:
        base = self.dir / f"h{i}"
        base.mkdir(exist_ok=True)
        inv = base / "inventory.yaml"
        gpus = [
            {"index": g, "uuid": f"GPU-h{i}-{g}", "model": "H100-80GB", "memory_mib": 81559}
            for g in range(GPUS)
        ]
        inv.write_text(yaml.safe_dump({"hostname": f"h{i}", "gpus": gpus}))
        argv = [sys.executable, "-m", "rackplane_agent", "--api", self.url]
        argv += ["--state-dir", str(base / "state"), "--inventory", str(inv)]
        argv += ["--address", self.hosts.address(i), "--data-interface", "eth0"]
        argv += ["--poll-wait", "20", "--work-dir", str(self.dir / f"h{i}-work")]
        if join:
            token = self.http.post(
                f"/v1/admin/nodes/{self.node_ids[f'h{i}']}/join-tokens",
                headers={"Authorization": f"Bearer {self.operator}"},
            ).json()["token"]
            argv += ["--token", token]
        self.agents[i] = self.hosts.popen(
            i,
            argv,
            cwd=ROOT,
            env=self.dep.env,
            stdout=open(base / "agent.log", "ab"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 180) -> None:
        def ready() -> bool:
            nodes = self.op_get("/v1/admin/nodes")["items"]
            return all(
                n["state"] == "ready" and n["health"] == "healthy" and n["production_at"]
                for n in nodes
            )

        # (`production_at`: its agent joined and its first burn-in passed: work on it is the
        # agent's to run, not the simulated provider's.)
        _until(ready, timeout, "every host's agent joined, ready and healthy")

    def lose(self, i: int) -> float:
        at = self.hosts.lose(i)
        self.agents.pop(i).wait(timeout=10)
        return at

    def bring_back(self, i: int) -> None:
        """The lost host back: its link, a new agent. A host lost again soon after its last
        repair is taken out of service (the health loop's escalation, as it should): the
        operator releases it, since here the loss was the bench's doing."""
        self.hosts.restore(i)
        self.start_agent(i)
        node_id = self.node_ids[f"h{i}"]
        op = {"Authorization": f"Bearer {self.operator}"}

        def settled() -> str | None:
            health = self.op_get(f"/v1/admin/nodes/{node_id}")["health"]
            return health if health in ("healthy", "out_of_service", "quarantined") else None

        if _until(settled, 120, f"h{i} back or out of service") != "healthy":
            self.http.post(
                f"/v1/admin/nodes/{node_id}/health",
                json={"action": "release", "reason": "the bench lost it on purpose"},
                headers=op,
            ).raise_for_status()
        self.wait_ready()

    def close(self) -> None:
        for i in list(self.agents):
            self.hosts.lose(i)
        self.hosts.remove()
        if hasattr(self, "http"):
            self.http.close()
        self.dep.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.time() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def one_run(c: Cluster, elastic: bool, steps: int = 2000) -> dict[str, float]:
    """One job, one lost host; the figures of that run."""
    tenant = {"Authorization": f"Bearer {c.key}"}
    replicas = c.n - 1
    body: dict[str, Any] = {
        "kind": "job",
        "gpus": GPUS,
        "replicas": replicas,
        "command": [
            str(TRAIN_PY),
            "-u",
            str(DDP),
            "--steps",
            str(steps),
            "--step-seconds",
            str(STEP_S),
            "--checkpoint-every",
            str(CHECKPOINT_EVERY),
            "--checkpoint-dir",
            str(c.ckpt),
        ],
    }
    if elastic:
        body["elastic"] = {"min_replicas": max(1, replicas - 1)}
    made = c.http.post("/v1/workloads", json=body, headers=tenant)
    made.raise_for_status()
    wid = made.json()["id"]

    def get() -> dict:
        return c.http.get(f"/v1/workloads/{wid}", headers=tenant).json()

    def logs() -> str:
        r = c.http.get(
            f"/v1/workloads/{wid}/logs", params={"limit": 1000, "replica": 0}, headers=tenant
        )
        return "".join(x["data"] for x in r.json()["items"])

    try:
        _until(lambda: get()["state"] == "running", 180, "the job running")
        _until(
            lambda: (get()["last_checkpoint_step"] or 0) >= CHECKPOINT_EVERY, 180, "a checkpoint"
        )
        time.sleep(CHECKPOINT_EVERY * STEP_S / 2)  # lose it between two checkpoints
        w = get()
        last = max(p["replica"] for p in w["placement"])
        node = next(p["node"] for p in w["placement"] if p["replica"] == last)
        host = int(node.removeprefix("h"))
        lost_at = c.lose(host)
        c.log(f"  lost {node} (rank {last}) at step ~{_last_step(logs(), lost_at)}")
        _until(lambda: get()["attempts"] >= 2, 120, "a new attempt")
        events = c.http.get(f"/v1/workloads/{wid}/events", headers=tenant).json()["items"]
        acted = next(
            e["at"]
            for e in events
            if (e["to_state"] == "queued" and e["from_state"] == "preempted")
        )
        detect = datetime.fromisoformat(acted).timestamp() - lost_at
        resumed = _until(lambda: _resumed(logs()), 180, "training to step again")
        step, first_t = resumed
        before = _last_step(logs(), lost_at)
        events = c.http.get(f"/v1/workloads/{wid}/events", headers=tenant).json()["items"]
        out = {
            "detect_s": round(detect, 3),
            "resume_s": round(first_t - lost_at, 3),
            "steps_lost": max(0, before - step),
            # The phases, from the loss: placed again, every replica's process up.
            "placed_s": _phase(events, "placing", lost_at),
            "running_s": _phase(events, "running", lost_at),
        }
        c.log(f"  {'elastic' if elastic else 'fixed'}: {out}")
        return out
    finally:
        c.http.delete(f"/v1/workloads/{wid}", headers=tenant)
        if "host" in locals():
            c.bring_back(host)


_STEP = re.compile(r"^step (\d+)/\d+ loss=\S+ world=\d+ backend=\w+ t=([0-9.]+)$", re.M)


def _last_step(out: str, before: float) -> int:
    """Rank 0's last step before `before` (its wall clock)."""
    done = [
        int(s) for s, t in _STEP.findall(out.split("resumed from step")[0]) if float(t) < before
    ]
    return max(done, default=0)


def _resumed(out: str) -> tuple[int, float] | None:
    """(the checkpoint's step, when the first step after it was done), once it was."""
    m = re.search(r"resumed from step (\d+)", out)
    if not m:
        return None
    after = _STEP.search(out, m.end())
    return (int(m.group(1)), float(after.group(2))) if after else None


def _phase(events: list[dict], state: str, since: float) -> float | None:
    """Seconds from `since` to the first transition to `state` after it."""
    for e in events:
        at = datetime.fromisoformat(e["at"]).timestamp()
        if e["kind"] == "transition" and e["to_state"] == state and at > since:
            return round(at - since, 3)
    return None


def _p(xs: list[float]) -> dict[str, float]:
    return {"p50": round(pct(xs, 0.5), 3), "p95": round(pct(xs, 0.95), 3)}


def bench(hosts: int = 4, runs: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    why = unavailable()
    if why:
        raise Unavailable(why)
    if hosts < 3:
        raise ValueError("at least 3 hosts: a gang of two and a spare")
    c = Cluster(hosts, log)
    results: dict[str, list[dict[str, float]]] = {"fixed": [], "elastic": []}
    try:
        for r in range(runs):
            for mode in ("fixed", "elastic"):
                log(f"run {r + 1}/{runs} {mode}")
                results[mode].append(one_run(c, elastic=mode == "elastic"))
    finally:
        c.close()
    every = results["fixed"] + results["elastic"]
    return {
        "hosts": hosts,
        "runs": runs,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
        "detect_s": _p([x["detect_s"] for x in every]),
        "resume_s_fixed": _p([x["resume_s"] for x in results["fixed"]]),
        "resume_s_elastic": _p([x["resume_s"] for x in results["elastic"]]),
        "steps_lost": _p([float(x["steps_lost"]) for x in every]),
        "phases": {
            mode: {
                k: _p([x[k] for x in results[mode] if x[k] is not None])
                for k in ("detect_s", "placed_s", "running_s", "resume_s")
            }
            for mode in ("fixed", "elastic")
        },
        "per_run": results,
    }
