"""Could the region's fleet ever hold a request, if nothing else ran? A request no such fleet
could hold (more GPUs per replica than any node has, a gang larger than the models' nodes, a
required NVLink domain, rack or block smaller than the gang, a confidential VM on a model
without confidential computing) is refused at submission with the reason, instead of queueing
for ever. Every node counts whatever its state: a cordoned or down node may come back.

Pure: the caller reads the region's nodes (`NodeCap`) and the request's facts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from app.placement.catalog import GPU_MODELS


@dataclass(frozen=True)
class NodeCap:
    model: str
    gpus: int
    domain: str  # NVLink domain
    rack: str
    block: str


def _cc_whole_node(n: NodeCap) -> bool:
    model = GPU_MODELS.get(n.model)
    return model is not None and model.cc_whole_node


def never_fits(
    nodes: list[NodeCap],
    *,
    models: tuple[str, ...],
    unit: str,  # whole | mig | fraction
    gpus: int,
    replicas: int,
    kind: str,
    confidential: bool,
    topology: dict | None,
) -> str | None:
    """Why the request could never be placed in these nodes, or None when it could."""
    allowed = [n for n in nodes if not models or n.model in models]
    what = ", ".join(models) if models else "any model"
    if confidential:
        allowed = [
            n for n in allowed if GPU_MODELS.get(n.model) and GPU_MODELS[n.model].confidential
        ]
        if not allowed:
            return f"no GPU of {what} here supports confidential computing"
    if unit == "mig":
        allowed = [
            n for n in allowed if GPU_MODELS.get(n.model) and GPU_MODELS[n.model].mig_capable
        ]
        if not allowed:
            return f"no GPU of {what} here supports MIG"
    per = gpus if unit == "whole" else 1

    # Replicas each node could hold alone: a multi-GPU confidential VM on Hopper takes the
    # whole node (protected PCIe); MIG slices and shares, up to 7 per GPU.
    def holds(n: NodeCap) -> int:
        if unit != "whole":
            return n.gpus * 7
        whole_node = confidential and per > 1 and _cc_whole_node(n)
        return (1 if n.gpus >= per else 0) if whole_node else n.gpus // per

    slots = [(n, holds(n)) for n in allowed]
    if not any(s for _, s in slots):
        biggest = max((n.gpus for n in allowed), default=0)
        return f"no node of {what} has {per} GPUs (the largest has {biggest})"
    total = sum(s for _, s in slots)
    if total < replicas:
        nodes_of = f"the {what} nodes here" if models else "the nodes here"
        return (
            f"{nodes_of} hold at most {total} replicas of {per} GPU(s); "
            f"{replicas} were asked for"
        )
    if topology and topology.get("mode") == "required":
        level = topology["level"]
        key = {"nvlink_domain": "domain", "rack": "rack", "block": "block"}[level]
        groups: dict[str, int] = defaultdict(int)
        for n, s in slots:
            groups[getattr(n, key)] += s
        best = max(groups.values())
        if best < replicas:
            return (
                f"no {level.replace('_', ' ')} holds {replicas} replicas of {per} GPU(s) "
                f"(the largest holds {best})"
            )
    return None
