"""Isolation tiers and the one table that says who may share hardware with whom.

Performance isolation (whole GPU, MIG, MPS, time-slicing) and security isolation (container,
VM, confidential VM) are separate axes; a tier is one combination of the two that we sell.
The rules follow shared/reference/gpu.md conservatively:
- time-slicing and MPS have no fault (and, for time-slicing, no memory) isolation: one tenant;
- MIG has hardware memory/fault isolation: across tenants in `mig-shared`, one tenant in
  `mig-dedicated` (for customers whose policy forbids co-tenancy);
- dedicated GPUs, VMs and confidential VMs get whole GPUs that nobody shares;
- a multi-GPU confidential VM on Hopper claims the node's NVSwitches: the whole node;
- on Hopper HGX, CC mode is node-wide (NVIDIA supports all GPUs in CC mode, each to one
  confidential VM, or all in protected-PCIe mode, all to one): a node with a confidential VM
  takes only confidential VMs (of any tenant, one GPU each), and a confidential VM goes only
  to a node with nothing else on it (`Snapshot.node_cc`, checked by the engine);
- on Blackwell (B200, GB200) a confidential VM of 1, 2, 4 or 8 GPUs takes just its GPUs
  (multi-GPU passthrough CC); other work may use the node's other GPUs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.IntEnum):
    TIMESLICE = 1
    MPS = 2
    MIG_SHARED = 3
    MIG_DEDICATED = 4
    DEDICATED = 5
    VM = 6
    CONFIDENTIAL_VM = 7

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, text: str) -> Tier:
        return cls[text.upper().replace("-", "_")]


class Unit(enum.Enum):
    """What a tier hands out."""

    FRACTION = "fraction"  # milli-GPU + GPU memory on one GPU
    MIG = "mig"  # a MIG slice
    WHOLE = "whole"  # whole GPUs


class Share(enum.Enum):
    NEVER = "never"
    SAME_TENANT = "same-tenant"
    ANY_TENANT = "any-tenant"


@dataclass(frozen=True)
class TierRule:
    unit: Unit
    security: str  # container | vm | confidential-vm
    performance: str  # time-slicing | mps | mig | whole-gpu


TIERS: dict[Tier, TierRule] = {
    Tier.TIMESLICE: TierRule(Unit.FRACTION, "container", "time-slicing"),
    Tier.MPS: TierRule(Unit.FRACTION, "container", "mps"),
    Tier.MIG_SHARED: TierRule(Unit.MIG, "container", "mig"),
    Tier.MIG_DEDICATED: TierRule(Unit.MIG, "container", "mig"),
    Tier.DEDICATED: TierRule(Unit.WHOLE, "container", "whole-gpu"),
    Tier.VM: TierRule(Unit.WHOLE, "vm", "whole-gpu"),
    Tier.CONFIDENTIAL_VM: TierRule(Unit.WHOLE, "confidential-vm", "whole-gpu"),
}


def _gpu_share_table() -> dict[tuple[Tier, Tier], Share]:
    table = {(a, b): Share.NEVER for a in Tier for b in Tier}
    table[(Tier.TIMESLICE, Tier.TIMESLICE)] = Share.SAME_TENANT
    table[(Tier.MPS, Tier.MPS)] = Share.SAME_TENANT
    table[(Tier.MIG_SHARED, Tier.MIG_SHARED)] = Share.ANY_TENANT
    table[(Tier.MIG_DEDICATED, Tier.MIG_DEDICATED)] = Share.SAME_TENANT
    table[(Tier.MIG_SHARED, Tier.MIG_DEDICATED)] = Share.SAME_TENANT
    table[(Tier.MIG_DEDICATED, Tier.MIG_SHARED)] = Share.SAME_TENANT
    return table


# GPU_SHARE[(tier already on the GPU, tier of the newcomer)]: may they share one GPU?
GPU_SHARE: dict[tuple[Tier, Tier], Share] = _gpu_share_table()


def may_share_gpu(held: Tier, held_tenant: int, new: Tier, new_tenant: int) -> bool:
    rule = GPU_SHARE[(held, new)]
    return rule is Share.ANY_TENANT or (rule is Share.SAME_TENANT and held_tenant == new_tenant)


def claims_whole_node(tier: Tier, gpus: int, cc_whole_node: bool) -> bool:
    """A multi-GPU confidential VM on Hopper uses protected PCIe: it takes the whole node."""
    return tier is Tier.CONFIDENTIAL_VM and gpus > 1 and cc_whole_node
