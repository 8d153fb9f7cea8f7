"""Every path of the health state machine, driven to its end on a real Celery worker: each GPU
and node gets back to `healthy` by itself when the hardware is fine (or to its correct terminal
state when it is not), within a bounded time, with no stray incident.

The paths (app/health/states.py) and what moves each state on:
- healthy -> suspect (a warning) -> healthy: the sweep, after the watch window without evidence;
- healthy -> quarantined [-> draining] -> repairing -> validating -> healthy: the provider's
  repair (`health.repair`), then validation;
- node reboot: the same for the node and the GPUs that faulted; a node with an agent that has not
  reported since the reboot is `unreachable` until it does, then validated with its GPUs;
- heartbeat lost (a node with an agent): unreachable -> repairing (power-cycled) -> validating ->
  unreachable -> (it reports) -> validating -> healthy; or, when it reports while being
  power-cycled, at once -> validating -> healthy;
- out_of_service: an RMA-class fault, a fault after a repair, a failed repair (terminal until an
  operator returns it: -> validating -> healthy).

The suite's short timers (tests/conftest.py): reboot 2 s, reset 0.5 s, validation 0.5 s, sweep
1 s. The heartbeat timeout is the worker's 90 s; the checks for silence run the sweep here with a
short one (the sweep reads it at run time)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from sqlalchemy import text

from app.core.config import get_settings
from app.health import tasks
from app.outbox.service import publish, send
from tests.fixtures.health import exporter_text, history, push
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import auth, wait_until

BOUND = 20.0  # seconds: every path ends within this
RADIUS = {"max_gpus": 8, "max_region_share": 0.5}


# --- a world to drive ---------------------------------------------------------------------------


@dataclass
class Ctx:
    client: object
    op: str
    key: str
    session: object
    monkeypatch: pytest.MonkeyPatch
    # What the case expects at its end: (node, GPU index or None) -> state; the rest healthy.
    terminal: dict = field(default_factory=dict)
    agents: set = field(default_factory=set)

    def sql(self, q: str, **kw):
        self.session.rollback()
        return self.session.execute(text(q), kw)

    def states(self) -> dict[tuple[str, int | None], str]:
        nodes = {(n, None): h for n, h in self.sql("SELECT name, health FROM nodes")}
        gpus = {
            (n, i): h
            for n, i, h in self.sql(
                "SELECT n.name, g.index, g.health FROM gpus g JOIN nodes n ON n.id = g.node_id"
            )
        }
        return {**nodes, **gpus}

    def incidents(self) -> list[tuple[str, str, int | None]]:
        return [
            tuple(r)
            for r in self.sql(
                "SELECT n.name, i.signal, i.code FROM health_incidents i "
                "JOIN nodes n ON n.id = i.node_id ORDER BY i.opened_at"
            )
        ]

    def xid(self, node: str, gpu: int, code: int) -> None:
        r = push(self.client, self.op, exporter_text(node, {"DCGM_FI_DEV_XID_ERRORS": {gpu: code}}))
        assert r.status_code == 200 and r.json()["signals"] == (1 if code else 0), r.text

    def report(self, node: str) -> None:
        """The node's agent reports (a heartbeat, no samples)."""
        r = self.client.post(
            "/v1/admin/telemetry", json={"samples": [], "nodes": [node]}, headers=auth(self.op)
        )
        assert r.status_code == 200, r.text

    def agent(self, node: str) -> None:
        """The node gets an agent: a stream of reports, a third of the heartbeat timeout apart,
        over two thirds of it (under a short timeout here; the worker's stays 90 s)."""
        s = get_settings()
        self.monkeypatch.setattr(s, "heartbeat_timeout_seconds", 0.9)
        for _ in range(3):
            self.report(node)
            time.sleep(0.35)
        self.monkeypatch.setattr(s, "heartbeat_timeout_seconds", 90.0)
        self.agents.add(node)

    def silence(self, timeout: float = 0.3) -> dict:
        """The heartbeat timeout passes with no report from anyone: one sweep, here."""
        self.monkeypatch.setattr(get_settings(), "heartbeat_timeout_seconds", timeout)
        time.sleep(timeout + 0.1)
        out = tasks.sweep()
        self.monkeypatch.setattr(get_settings(), "heartbeat_timeout_seconds", 90.0)
        return out

    def wait(self, cond: Callable[[], bool], timeout: float = BOUND) -> None:
        wait_until(cond, timeout=timeout, interval=0.2)

    def at(self, node: str, gpu: int | None = None) -> str:
        return self.states()[(node, gpu)]

    def settled(self) -> bool:
        """Every node and GPU is healthy, but for the case's terminal states."""
        return all(h == self.terminal.get(k, "healthy") for k, h in self.states().items())


@pytest.fixture
def ctx(client, world, session, monkeypatch, celery_worker_process):
    world.fleet(fleet(2))  # h1, h2: HGX H100 x8
    key, op = world.key(world.tenant("acme", policy=ALL)), world.key(None)
    return Ctx(client, op, key, session, monkeypatch)


def _instance(c: Ctx) -> tuple[str, int, str]:
    """A 1-GPU instance, running: its node, GPU and id."""
    w = c.client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(c.key))
    wid = w.json()["id"]
    c.wait(lambda: _workload(c, wid)["state"] == "running")
    [p] = _workload(c, wid)["placement"]
    return p["node"], p["gpu_indices"][0], wid


def _workload(c: Ctx, wid: str) -> dict:
    return c.client.get(f"/v1/workloads/{wid}", headers=auth(c.key)).json()


def _chaos(c: Ctx, fault: dict) -> dict:
    r = c.client.post(
        "/v1/admin/chaos/experiments",
        json={"name": "paths", "faults": [fault], "blast_radius": RADIUS},
        headers=auth(c.op),
    )
    assert r.status_code == 201, r.text
    return r.json()


def _stop(c: Ctx, exp: dict) -> None:
    r = c.client.post(f"/v1/admin/chaos/experiments/{exp['id']}/stop", headers=auth(c.op))
    assert r.json()["state"] == "stopped", r.text


# --- the paths ----------------------------------------------------------------------------------
# Each drives its fault and returns (node, GPU): whose history the case checks.


def app_error(c: Ctx):
    c.xid("h1", 0, 13)
    c.wait(lambda: c.incidents() == [("h1", "xid", 13)])
    return "h1", 0


def watched(c: Ctx):
    c.xid("h1", 1, 92)
    c.wait(lambda: c.at("h1", 1) == "suspect")
    # The watch window passes with no new evidence: the sweep clears it.
    c.monkeypatch.setattr(get_settings(), "breaker_window_seconds", 0.5)
    time.sleep(0.6)
    assert tasks.sweep()["cleared"] == 1
    return "h1", 1


def reset(c: Ctx):
    c.xid("h1", 2, 48)
    return "h1", 2


def reset_with_work(c: Ctx):
    node, gpu, wid = _instance(c)
    c.xid(node, gpu, 48)
    c.wait(lambda: _workload(c, wid)["interruptions"] == 1)
    c.wait(lambda: _workload(c, wid)["state"] == "running")
    return node, gpu


def nvlink(c: Ctx):
    c.xid("h1", 4, 74)
    return "h1", 4


def reboot(c: Ctx):
    c.xid("h1", 3, 79)
    return "h1", 3


def reboot_with_work(c: Ctx):
    node, gpu, wid = _instance(c)
    c.xid(node, gpu, 79)
    c.wait(lambda: _workload(c, wid)["interruptions"] == 1)
    return node, gpu


def reboot_agent_silent(c: Ctx):
    """Xid 79 -> reboot -> no report since: unreachable -> one report -> the node validated,
    and ALL its GPUs with it (issue 34: GPU 0 stayed validating)."""
    c.agent("h1")
    c.xid("h1", 0, 79)
    c.wait(lambda: history(c.session, "h1")[-1:] == ["unreachable"])
    c.report("h1")
    return "h1", 0


def heartbeat_lost(c: Ctx):
    c.agent("h1")
    assert c.silence(timeout=0.9)["silent"] == 1
    # Power-cycled; still silent after it: unreachable again, until its agent reports.
    c.wait(lambda: history(c.session, "h1")[-2:] == ["validating", "unreachable"])
    c.report("h1")
    return "h1", None


def heartbeat_lost_agent_back(c: Ctx):
    """Issue 45 item 8: its agent reports again while it is being power-cycled: the reboot is
    not waited out (it was 180 s by the provider, whatever the agent said)."""
    c.agent("h1")
    assert c.silence(timeout=0.9)["silent"] == 1
    c.wait(lambda: c.at("h1") == "repairing")
    # A provider's reboot that would take an hour.
    c.sql("UPDATE health_repairs SET due_at = now() + interval '1 hour' WHERE finished_at IS NULL")
    c.session.commit()
    c.report("h1")
    assert tasks.sweep()["back"] == 1
    why = c.sql(
        "SELECT e.cause FROM health_events e JOIN nodes n ON n.id = e.node_id "
        "WHERE n.name = 'h1' AND e.gpu_index IS NULL ORDER BY e.id DESC LIMIT 1"
    ).scalar()
    assert "the power cycle is not waited out" in why, why
    return "h1", None


def service(c: Ctx):
    c.terminal[("h1", 5)] = "out_of_service"
    c.xid("h1", 5, 64)
    return "h1", 5


def refault(c: Ctx):
    c.terminal[("h1", 6)] = "out_of_service"
    c.xid("h1", 6, 48)
    c.wait(lambda: history(c.session, "h1", 6)[-1:] == ["healthy"])
    c.xid("h1", 6, 0)  # the gauge clears
    c.xid("h1", 6, 48)  # a new fault, after the repair
    return "h1", 6


def failed_repair(c: Ctx):
    c.terminal[("h1", 7)] = "out_of_service"
    exp = _chaos(c, {"kind": "provider", "fails": "repair", "target": {"node": "h1"}})
    c.xid("h1", 7, 48)
    c.wait(lambda: c.at("h1", 7) == "out_of_service")
    _stop(c, exp)
    return "h1", 7


def released_after_rma(c: Ctx):
    c.xid("h2", 5, 64)
    c.wait(lambda: c.at("h2", 5) == "out_of_service")
    gpu = c.sql(
        "SELECT g.id FROM gpus g JOIN nodes n ON n.id = g.node_id WHERE n.name = 'h2' "
        "AND g.index = 5"
    ).scalar()
    r = c.client.post(
        f"/v1/admin/gpus/{gpu}/health", json={"action": "release"}, headers=auth(c.op)
    )
    assert r.status_code == 200 and r.json()["health"] == "validating", r.text
    return "h2", 5


Q, D, R, V, H = "quarantined", "draining", "repairing", "validating", "healthy"
U, OOS = "unreachable", "out_of_service"

# name, drive, the GPU's path, the node's path, the incidents (signal, code) on the node.
PATHS = [
    ("app_error", app_error, [], [], [("xid", 13)]),
    ("watch", watched, ["suspect", H], [], [("xid", 92)]),
    ("reset", reset, [Q, R, V, H], [], [("xid", 48)]),
    ("reset_with_work", reset_with_work, [Q, D, R, V, H], [], [("xid", 48)]),
    ("nvlink", nvlink, [Q, R, V, H], [], [("xid", 74)]),
    ("reboot", reboot, [Q, R, V, H], [Q, R, V, H], [("xid", 79)]),
    ("reboot_with_work", reboot_with_work, [Q, D, R, V, H], [Q, D, R, V, H], [("xid", 79)]),
    (
        "reboot_agent_silent",
        reboot_agent_silent,
        [Q, R, V, H],
        [Q, R, V, U, V, H],
        [("xid", 79)],
    ),
    ("heartbeat_lost", heartbeat_lost, None, [U, R, V, U, V, H], [("heartbeat_lost", None)]),
    (
        "heartbeat_lost_agent_back",
        heartbeat_lost_agent_back,
        None,
        [U, R, V, H],
        [("heartbeat_lost", None)],
    ),
    ("service", service, [OOS], [], [("xid", 64)]),
    ("refault", refault, [Q, R, V, H, OOS], [], [("xid", 48)]),
    ("failed_repair", failed_repair, [Q, R, OOS], [], [("xid", 48)]),
    ("released_after_rma", released_after_rma, [OOS, V, H], [], [("xid", 64)]),
]


@pytest.mark.parametrize(
    ("drive", "gpu_path", "node_path", "incidents"),
    [p[1:] for p in PATHS],
    ids=[p[0] for p in PATHS],
)
def test_each_path_ends_where_it_should(ctx, drive, gpu_path, node_path, incidents):
    t0 = time.monotonic()
    node, gpu = drive(ctx)

    def ended():
        return (
            [(s, c) for _n, s, c in ctx.incidents()] == incidents
            and (gpu is None or history(ctx.session, node, gpu) == gpu_path)
            and history(ctx.session, node) == node_path
            and ctx.settled()
        )

    try:
        ctx.wait(ended, timeout=max(1.0, BOUND - (time.monotonic() - t0)))
    except AssertionError:
        out = {k: v for k, v in ctx.states().items() if v != "healthy"}
        gpu_hist = history(ctx.session, node, gpu) if gpu is not None else None
        raise AssertionError(
            f"not at its end within {BOUND} s: out {out}; GPU {gpu_hist}; "
            f"node {history(ctx.session, node)}; incidents {ctx.incidents()}"
        ) from None
    assert all(n == node for n, _s, _c in ctx.incidents())
    # Nothing more happens by itself: no node without an agent "stops reporting"; every state
    # stays where it ended.
    if ctx.agents:
        time.sleep(1.0)  # a worker sweep
    else:
        assert ctx.silence()["silent"] == 0
    assert ended()


# --- issue 34's three reports -------------------------------------------------------------------


def test_a_replayed_fault_after_its_repair_is_no_refault(ctx):
    """A chaos Xid on a GPU, repaired; then the same fault's message is delivered again (the
    outbox sends again what it could not mark sent: a CLI that exits at once, a lost mark). The
    GPU stays healthy: the fault is older than its repair."""
    exp = _chaos(ctx, {"kind": "xid", "code": 48, "target": {"node": "h1", "gpu": 3}})
    ctx.wait(lambda: history(ctx.session, "h1", 3)[-1:] == ["healthy"])
    [mid] = ctx.sql("SELECT id FROM outbox WHERE task = 'health.evaluate'").scalars().all()
    ctx.sql("UPDATE outbox SET sent_at = NULL WHERE id = :m", m=mid)
    ctx.session.commit()
    assert send(ids=[mid]) == 1
    # A marker after it on the same queue (one worker process: in order): an application error
    # on h2. Once it is seen, the replay has been evaluated.
    marker = [
        {"gpu_index": 0, "signal": "xid", "code": 13, "value": 13, "at": time.time()},
    ]
    h2 = ctx.sql("SELECT id FROM nodes WHERE name = 'h2'").scalar()
    publish("health.evaluate", kwargs={"node_id": str(h2), "signals": marker}, queue="health")
    ctx.wait(lambda: ("h2", "xid", 13) in ctx.incidents())
    assert ctx.at("h1", 3) == "healthy"
    assert history(ctx.session, "h1", 3) == ["quarantined", "repairing", "validating", "healthy"]
    _stop(ctx, exp)
    assert ctx.silence()["silent"] == 0
    assert ctx.settled()
    assert ctx.incidents() == [("h1", "xid", 48), ("h2", "xid", 13)]


def test_a_chaos_reboot_ends_with_the_node_and_every_gpu_healthy(ctx):
    """Chaos Xid 79 on GPU 3: the injection is no agent, so the rebooted node is validated by
    time, with its GPUs; the experiment stops; nothing stops reporting."""
    exp = _chaos(ctx, {"kind": "xid", "code": 79, "target": {"node": "h1", "gpu": 3}})
    ctx.wait(lambda: history(ctx.session, "h1")[-1:] == ["healthy"] and ctx.settled())
    assert history(ctx.session, "h1", 3) == ["quarantined", "repairing", "validating", "healthy"]
    _stop(ctx, exp)
    assert ctx.silence()["silent"] == 0
    assert ctx.settled()
    assert ctx.incidents() == [("h1", "xid", 79)]


def test_one_push_is_no_agent_but_a_stream_is(ctx):
    """A single telemetry push (an operator's, a chaos injection's) and then silence: no 'node
    agent stopped reporting'. A node whose reports came as a stream does have an agent: its
    silence is an incident."""
    s = get_settings()
    ctx.monkeypatch.setattr(s, "heartbeat_timeout_seconds", 0.6)
    r = push(ctx.client, ctx.op, exporter_text("h1", {"DCGM_FI_DEV_GPU_TEMP": {0: 40}}))
    assert r.status_code == 200 and r.json()["nodes"] == 1
    time.sleep(0.8)  # past the heartbeat timeout
    assert tasks.sweep()["silent"] == 0
    # A stream on h2: reports a third of the timeout apart, over two thirds of it.
    for _ in range(3):
        ctx.report("h2")
        time.sleep(0.25)
    time.sleep(0.6)
    assert tasks.sweep()["silent"] == 1
    ctx.wait(lambda: ctx.at("h2") != "healthy", timeout=10)
    ctx.monkeypatch.setattr(s, "heartbeat_timeout_seconds", 90.0)
    assert [(n, sig) for n, sig, _c in ctx.incidents()] == [("h2", "heartbeat_lost")]
    assert ctx.at("h1") == "healthy"
    assert all(ctx.at("h1", g) == "healthy" for g in range(8))
