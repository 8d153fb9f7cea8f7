"""What the agent needs before its threads start: its state directory (locked, one agent per
directory), the node's credential (the stored one, else a join with the token) and the host's
first inventory.

Whatever fails here is a StartupError: the agent exits 2 (EXIT_USAGE) before its threads
start, since the fix is the operator's (a token, an inventory, another agent to stop).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rackplane_agent import inventory as inventory_mod
from rackplane_agent.client import ApiError, Client, JoinRefused, TransientError
from rackplane_agent.config import AgentConfig
from rackplane_agent.logfmt import kv
from rackplane_agent.state import StateDir, StateDirBusy, iso
from rackplane_wire import Inventory

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")


class StartupError(Exception):
    """The agent cannot start (exit 2): no token, no inventory, a busy state directory."""


def lock_state(state: StateDir) -> None:
    """Make the state directory and lock it for this agent alone."""
    state.ensure()
    try:
        state.lock()
    except StateDirBusy as exc:
        raise StartupError(str(exc)) from None


def connect(client: Client, state: StateDir, config: AgentConfig, stop: threading.Event) -> None:
    """Give `client` the node credential: the stored one, else a join with the token (kept
    in the state directory)."""
    credential = state.read_credential()
    if credential:
        client.credential = credential
        node = state.read_node()
        log.info(kv("credential_loaded", node=node.get("node_name"), state_dir=state.root))
        return
    if not config.token:
        raise StartupError(
            f"this node has not joined (no {state.credential_file}) and no join token "
            "was given: pass --token rpj_... or set RACKPLANE_JOIN_TOKEN"
        )
    try:
        joined = client.join(config.token, attempts=None, stop_event=stop)
    except JoinRefused as exc:
        raise StartupError(f"the join token was refused: {exc.code} {exc.detail}") from None
    except TransientError as exc:
        raise StartupError(f"cannot reach {config.api} to join: {exc}") from None
    except ApiError as exc:
        raise StartupError(f"join failed: {exc}") from None
    node = {k: joined.get(k) for k in ("node_id", "node_name", "credential_prefix")}
    state.write_credential(joined["credential"], {**node, "joined_at": iso(time.time())})
    log.info(
        kv(
            "joined",
            node=node["node_name"],
            node_id=node["node_id"],
            credential_prefix=node["credential_prefix"],
        )
    )


def first_inventory(config: AgentConfig, runtime_names: list[str], nvml: Any | None) -> Inventory:
    """The host's inventory as the agent starts: NVML's, else the inventory file's."""
    try:
        return inventory_mod.collect(
            inventory_file=config.inventory_file,
            address=config.address,
            runtimes=runtime_names,
            nvml=nvml,
        )
    except inventory_mod.InventoryError as exc:
        raise StartupError(str(exc)) from None


def log_inventory(inventory: Inventory) -> None:
    """One line on what the agent found on its host."""
    log.info(
        kv(
            "inventory",
            source=inventory.source,
            gpus=len(inventory.gpus),
            mig_instances=sum(len(g.mig_instances) for g in inventory.gpus),
            hostname=inventory.hostname,
            address=inventory.address,
            runtimes=",".join(inventory.runtimes),
        )
    )
