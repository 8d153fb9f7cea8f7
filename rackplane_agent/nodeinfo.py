"""The inventory the agent reports for its node: the host's, as `inventory.collect` reads it,
with the capabilities this agent adds (what it can do there beyond running its runtimes).

The sync thread sends it once (PUT /inventory) before it polls for assignments. It is read
again when the host changed under the agent (a MIG layout applied, an upgrade's burn-in), and
the reporter sends the new one with the next status.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from rackplane_agent import inventory as inventory_mod
from rackplane_agent import runtimes
from rackplane_agent.config import AgentConfig
from rackplane_agent.logfmt import kv
from rackplane_wire import Inventory

# The agent's own logger, not a child of it: these lines keep `logger=rackplane_agent`.
log = logging.getLogger("rackplane_agent")


def with_capabilities(
    inventory: Inventory,
    *,
    mig_able: bool,
    run_uids: bool,
    shared_volumes: bool,
    offered: Iterable[runtimes.Runtime],
) -> Inventory:
    """The inventory with what this agent can do (`mig-layout` when it can apply them)."""
    caps: list[Any] = ["mig-layout"] if mig_able else []
    if run_uids:
        caps.append("run-uids")
    caps.append("volumes")  # it mounts tenants' volumes (an older agent did not)
    if shared_volumes:
        caps.append("shared-volumes")
    caps += [c for runtime in offered for c in runtime.capabilities()]
    return inventory.model_copy(update={"capabilities": caps})


def collect_again(
    config: AgentConfig, known: Inventory, runtime_names: list[str], nvml: Any | None
) -> Inventory | None:
    """The host's inventory read again (without this agent's capabilities); None when it
    cannot be read."""
    try:
        return inventory_mod.collect(
            inventory_file=config.inventory_file,
            address=config.address or known.address,
            runtimes=runtime_names,
            nvml=nvml,
            hostname=known.hostname,
        )
    except inventory_mod.InventoryError as exc:
        log.error(kv("inventory_reread_failed", error=exc))
        return None


def log_change(known: Inventory, fresh: Inventory) -> None:
    """Log the versions a fresh inventory has, when it differs from the one known."""
    if fresh != known:
        log.info(
            kv(
                "inventory_changed",
                driver=fresh.driver_version,
                cuda=fresh.cuda_version,
                nccl=fresh.nccl_version,
                firmware=fresh.firmware_version,
            )
        )
