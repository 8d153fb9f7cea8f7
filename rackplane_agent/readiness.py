"""Whether a running run can be reached yet: an instance's SSH server greeting on its node
port (`sshports.banners`), a serving run's readiness path answering 2xx (`serving.ready`).

Each run not ready yet is knocked on at most every *_PROBE_INTERVAL, all due runs at once;
the first answer marks it ready, and the reporter tells the control plane. The agent picks
the due runs and marks the ready ones under its lock, and knocks in between without it: a
round of knocks may take up to its timeout, and the reconciler must not wait on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from rackplane_agent import serving, sshports
from rackplane_agent.logfmt import kv
from rackplane_agent.state import RUNNING, RunRecord

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")

SSH_PROBE_INTERVAL = 0.5  # seconds between two knocks on one run's SSH port
SSH_PROBE_TIMEOUT = 0.5  # what one round of knocks (every unready run at once) may take
SERVE_PROBE_INTERVAL = 0.25  # seconds between two GETs of a serving run's readiness path
SERVE_PROBE_TIMEOUT = 0.5


def ssh_due(
    runs: Iterable[RunRecord], next_probe: dict[str, float], mono: float
) -> list[tuple[str, int]]:
    """(run, port) for each running run to knock on now; each is next due an interval on."""
    due = [
        (r.key, r.ssh_port)
        for r in runs
        if r.state == RUNNING
        and r.ssh_port is not None
        and not r.ssh_ready
        and mono >= next_probe.get(r.key, 0.0)
    ]
    for key, _ in due:
        next_probe[key] = mono + SSH_PROBE_INTERVAL
    return due


def knock_ssh(due: list[tuple[str, int]]) -> set[int]:
    """The due ports on which an SSH server greets."""
    return sshports.banners([port for _, port in due], timeout=SSH_PROBE_TIMEOUT)


def mark_ssh_ready(
    runs: Mapping[str, RunRecord],
    due: list[tuple[str, int]],
    answered: set[int],
    next_probe: dict[str, float],
    clock: Callable[[], float],
    changed: Callable[[RunRecord], None],
) -> None:
    """Mark ready each due run still running whose SSH server greeted on the port it holds."""
    for key, port in due:
        rec = runs.get(key)
        if port not in answered or rec is None or rec.state != RUNNING:
            continue
        if rec.ssh_port != port or rec.ssh_ready:
            continue
        rec.ssh_ready = True
        next_probe.pop(key, None)
        after = clock() - rec.started_at if rec.started_at is not None else None
        log.info(
            kv(
                "ssh_ready",
                run=key,
                port=port,
                after_s=round(after, 2) if after is not None else None,
            )
        )
        changed(rec)


def serve_due(
    runs: Iterable[RunRecord], next_probe: dict[str, float], mono: float
) -> list[tuple[str, int, str]]:
    """(run, port, readiness path) for each running serving run to GET now; each is next due
    an interval on."""
    due = []
    for r in runs:
        serve = (r.assignment or {}).get("serve")
        if r.state != RUNNING or r.serve_port is None or r.serve_ready or not serve:
            continue
        if mono < next_probe.get(r.key, 0.0):
            continue
        next_probe[r.key] = mono + SERVE_PROBE_INTERVAL
        due.append((r.key, r.serve_port, serve["ready_path"]))
    return due


def knock_serving(due: list[tuple[str, int, str]]) -> set[int]:
    """The due ports whose readiness path answers 2xx."""
    return serving.ready([(p, path) for _, p, path in due], timeout=SERVE_PROBE_TIMEOUT)


def mark_serve_ready(
    runs: Mapping[str, RunRecord],
    due: list[tuple[str, int, str]],
    answered: set[int],
    next_probe: dict[str, float],
    clock: Callable[[], float],
    changed: Callable[[RunRecord], None],
) -> None:
    """Mark ready each due run still running whose readiness path answered on its port."""
    for key, port, _ in due:
        rec = runs.get(key)
        if port not in answered or rec is None or rec.state != RUNNING:
            continue
        if rec.serve_port != port or rec.serve_ready:
            continue
        rec.serve_ready = True
        next_probe.pop(key, None)
        after = clock() - rec.started_at if rec.started_at is not None else None
        log.info(
            kv(
                "serve_ready",
                run=key,
                port=port,
                after_s=round(after, 2) if after is not None else None,
            )
        )
        changed(rec)
