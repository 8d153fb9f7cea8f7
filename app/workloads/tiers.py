"""Choosing a workload's isolation tier from its request and its tenant's isolation policy.

The tenant's policy lists what it may be placed in (`shared-timeslice`, `shared-fractional`,
`shared-mig`, `dedicated-gpu`, `vm`, `confidential-vm`); the request says what it is (a
container on whole GPUs, a MIG slice or a fractional share; a VM; a gang job) and, optionally,
which isolation it wants. The result is one placement-core tier; every refusal names the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core.errors import ValidationFailed
from app.placement.catalog import GPU_MODELS
from app.placement.isolation import Tier

# Tenant policy names -> the placement tiers they allow.
POLICY_TIERS: dict[str, tuple[Tier, ...]] = {
    "shared-timeslice": (Tier.TIMESLICE,),
    "shared-fractional": (Tier.MPS,),
    "shared-mig": (Tier.MIG_SHARED,),
    # Exclusive GPUs; a MIG slice of a dedicated tenant shares its GPU with that tenant only.
    "dedicated-gpu": (Tier.DEDICATED, Tier.MIG_DEDICATED),
    "vm": (Tier.VM,),
    "confidential-vm": (Tier.CONFIDENTIAL_VM,),
}

# What a request may ask for, and the tiers that satisfy it, best first.
ISOLATION_CHOICES: dict[str, tuple[Tier, ...]] = {
    "shared-timeslice": (Tier.TIMESLICE,),
    "shared-fractional": (Tier.MPS,),
    "shared-mig": (Tier.MIG_SHARED,),
    "dedicated-mig": (Tier.MIG_DEDICATED,),
    "dedicated-gpu": (Tier.DEDICATED,),
    "vm": (Tier.VM,),
    "confidential-vm": (Tier.CONFIDENTIAL_VM,),
}


class IsolationRefused(ValidationFailed):
    code = "isolation_rule_violated"
    title = "Isolation rule violated"


@dataclass(frozen=True)
class ShapeFacts:
    unit: str  # whole | mig | fraction
    gpus: int  # per replica (whole GPUs)
    replicas: int
    gpu_models: tuple[str, ...]  # allowed models; () = any


def _refuse(rule: str, detail: str) -> IsolationRefused:
    return IsolationRefused(detail, rule=rule)


def choose_tier(kind: str, shape: ShapeFacts, isolation: str | None, policy: list[str]) -> Tier:
    allowed = {t for name in policy for t in POLICY_TIERS.get(name, ())}
    # Candidates from what the workload is.
    if kind == "vm":
        if shape.unit != "whole":
            raise _refuse(
                "vm_needs_whole_gpus",
                "A VM takes whole GPUs by passthrough; MIG slices and fractional shares are "
                "for containers.",
            )
        if shape.gpus not in (1, 2, 4, 8):
            raise _refuse("vm_gpu_count", "A VM takes 1, 2, 4 or 8 GPUs of one node.")
        candidates: tuple[Tier, ...] = (Tier.VM, Tier.CONFIDENTIAL_VM)
    elif shape.unit == "whole":
        candidates = (Tier.DEDICATED,)
    elif shape.unit == "mig":
        candidates = (Tier.MIG_SHARED, Tier.MIG_DEDICATED)
    else:
        candidates = (Tier.MPS, Tier.TIMESLICE)
    if isolation is not None:
        wanted = ISOLATION_CHOICES[isolation]
        if isolation == "confidential-vm" and shape.unit != "whole":
            raise _refuse(
                "confidential_vm_needs_whole_gpus",
                "A confidential VM takes whole GPUs; it cannot run on a MIG slice or a "
                "fractional share.",
            )
        if isolation == "confidential-vm" and kind != "vm":
            raise _refuse("confidential_vm_is_a_vm", "Confidential computing is sold as a VM.")
        candidates = tuple(t for t in candidates if t in wanted)
        if not candidates:
            raise _refuse(
                "isolation_does_not_fit_shape",
                f"Isolation {isolation!r} does not apply to a {kind} of {shape.unit} GPUs.",
            )
    permitted = [t for t in candidates if t in allowed]
    if not permitted:
        names = {
            Tier.MPS: "fractional shares",
            Tier.TIMESLICE: "time-sliced shares",
            Tier.MIG_SHARED: "MIG slices",
            Tier.MIG_DEDICATED: "MIG slices",
        }
        what = names.get(candidates[0], f"the {candidates[0].label} tier")
        raise _refuse(
            "tier_forbidden_by_tenant_policy",
            f"The tenant's isolation policy ({', '.join(policy) or 'empty'}) does not allow "
            f"{what}.",
        )
    tier = permitted[0]
    if tier is Tier.CONFIDENTIAL_VM and shape.gpu_models:
        if not any(GPU_MODELS[m].confidential for m in shape.gpu_models if m in GPU_MODELS):
            raise _refuse(
                "confidential_vm_unsupported_model",
                f"None of {', '.join(shape.gpu_models)} supports confidential computing.",
            )
    return tier
