"""Two of the agent's threads, those that only talk to the control plane: the sync loop (GET
/node and PUT /inventory once, then the long poll for assignments) and the telemetry loop
(the GPUs' samples, every `telemetry_interval`).

Each runs until the agent's stop event is set, and touches the agent only through what it is
given: the callables that hand it assignments or a fatal error. A refused credential is fatal
(the agent stops, its runs left running); anything else is retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rackplane_agent import telemetry
from rackplane_agent.client import (
    ApiError,
    Backoff,
    Client,
    CredentialRefused,
    RouteMissing,
)
from rackplane_agent.config import AgentConfig
from rackplane_agent.logfmt import kv
from rackplane_agent.state import StateDir
from rackplane_wire import Assignments, Inventory

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")


def check_node(client: Client, state: StateDir, retry: dict[str, Any]) -> None:
    """GET /node: the node's name, kept in the state directory when the control plane
    renamed it."""
    try:
        node = client.node(**retry)
    except RouteMissing:
        log.warning(kv("node_route_missing", detail="no GET /v1/agent/node; going on"))
        return
    known = state.read_node()
    if node.get("node_name") and node.get("node_name") != known.get("node_name"):
        state.write_node(
            {**known, "node_id": node.get("node_id"), "node_name": node.get("node_name")}
        )
    log.info(
        kv("node", name=node.get("node_name"), rack=node.get("rack"), region=node.get("region"))
    )


def put_inventory(client: Client, inventory: Inventory, retry: dict[str, Any]) -> None:
    """PUT /inventory, and log the control plane's verdict on it."""
    try:
        verdict = client.put_inventory(inventory, **retry)
    except RouteMissing:
        log.warning(kv("inventory_route_missing", detail="no PUT /v1/agent/inventory; going on"))
    else:
        (log.info if verdict.matches else log.warning)(
            kv(
                "inventory_verdict",
                node=verdict.node,
                matches=verdict.matches,
                node_state=verdict.node_state,
                differences="; ".join(verdict.differences) or None,
            )
        )


def sync_loop(
    client: Client,
    config: AgentConfig,
    state: StateDir,
    stop: threading.Event,
    *,
    send_inventory: Callable[[dict[str, Any]], None],
    known: Callable[[], Assignments | None],
    take: Callable[[Assignments], None],
    fatal: Callable[[BaseException], None],
) -> None:
    """GET /node, PUT /inventory (`send_inventory`), then the long poll for assignments, each
    answer handed to `take` (`known`: the assignments the agent holds), until `stop`."""
    backoff = Backoff(config.backoff_initial, config.backoff_max)
    retry: dict[str, Any] = {"attempts": None, "stop_event": stop}
    steps = ["node", "inventory"]
    index = 0
    while not stop.is_set():
        step = steps[0] if steps else "assignments"
        try:
            if step == "node":
                check_node(client, state, retry)
                steps.pop(0)
                continue
            if step == "inventory":
                send_inventory(retry)
                steps.pop(0)
                continue
            began = time.monotonic()
            assignments = client.assignments(index, config.poll_wait, **retry)
            if assignments.index != index or known() is None:
                log.info(
                    kv(
                        "assignments",
                        index=assignments.index,
                        runs=len(assignments.assignments),
                    )
                )
            quick = time.monotonic() - began < 0.05 and assignments.index == index
            index = assignments.index
            take(assignments)
            backoff.reset()
            if quick:  # a server answering at once with nothing new: do not spin
                stop.wait(min(1.0, config.poll_wait))
        except CredentialRefused as exc:
            fatal(exc)
            return
        except Exception as exc:  # ApiError (retried by going round), or a bug
            if stop.is_set():
                return  # a TransientError when stopping, or the client closed under it
            delay = backoff.next()
            if isinstance(exc, ApiError):
                log.error(kv("sync_error", step=step, error=exc, retry_in_s=round(delay, 2)))
            else:
                log.exception(kv("sync_crashed", step=step, error=exc))
            stop.wait(delay)


def telemetry_source(
    dcgm_exporter: str | None, nvml: Any | None, inventory: Inventory | None
) -> Any | None:
    """dcgm-exporter's scraper when one is given, else NVML's sampler; None: neither."""
    if dcgm_exporter:
        return telemetry.DcgmScraper(dcgm_exporter)
    if nvml is not None and inventory is not None:
        return telemetry.NvmlSampler(nvml, inventory.hostname)
    return None


def telemetry_loop(
    client: Client,
    config: AgentConfig,
    nvml: Any | None,
    inventory: Inventory | None,
    *,
    stop: threading.Event,
    inventory_sent: threading.Event,
    fatal: Callable[[BaseException], None],
) -> None:
    """POST /telemetry every `telemetry_interval` once the inventory is sent, until `stop`
    (or until the control plane turns out to have no such route)."""
    try:
        source = telemetry_source(config.dcgm_exporter, nvml, inventory)
    except Exception as exc:
        log.warning(kv("telemetry_unavailable", error=exc))
        return
    if source is None:
        return
    inventory_sent.wait()
    while not stop.is_set():
        try:
            text = source.collect()
            if text:
                client.telemetry(text)
        except RouteMissing:
            log.warning(
                kv(
                    "telemetry_route_missing",
                    detail="the control plane has no POST /v1/agent/telemetry",
                )
            )
            break
        except CredentialRefused as exc:
            fatal(exc)
            break
        except Exception as exc:  # the exporter or the server: next time
            log.warning(kv("telemetry_failed", error=exc))
        stop.wait(config.telemetry_interval)
    source.close()
