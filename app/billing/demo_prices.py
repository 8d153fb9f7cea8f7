"""The demo price book `make run` seeds, so the demo bills something.

On-demand whole-GPU prices are one provider's public list (shared/reference/gpu.md, 2026);
preemptible ones its spot node-hours divided by 8 where listed (H100, H200, B200), else 40 %
of on-demand (an assumption). The rest are this demo's choices, stated here: reserved at 65 %
of on-demand, shares and MIG slices at 110 % (per GPU-equivalent: packing costs the operator),
passthrough VMs at 105 %, confidential VMs at 120 %. Cents per GPU-hour of GPU-equivalents."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from app.billing.service import create_price

ON_DEMAND = {"GB200": 1050, "B200": 860, "H200-141GB": 631, "H100-80GB": 616, "A100-80GB": 270}
SPOT = {"B200": 3411 // 8, "H200-141GB": 2093 // 8, "H100-80GB": 1971 // 8}


def demo_prices() -> list[dict]:
    rows = []
    for model, cents in ON_DEMAND.items():
        spot = SPOT.get(model, cents * 40 // 100)
        for shape, tier, plan, amount in (
            ("whole", "*", "on_demand", cents),
            ("whole", "*", "reserved", cents * 65 // 100),
            ("whole", "*", "preemptible", spot),
            ("fractional", "*", "on_demand", cents * 110 // 100),
            ("fractional", "*", "preemptible", spot),
            ("mig", "*", "on_demand", cents * 110 // 100),
            ("mig", "*", "preemptible", spot),
            ("vm", "*", "on_demand", cents * 105 // 100),
            ("vm", "confidential-vm", "on_demand", cents * 120 // 100),
        ):
            rows.append(
                {
                    "gpu_model": model,
                    "shape": shape,
                    "tier": tier,
                    "region": "*",
                    "plan": plan,
                    "currency": "usd",
                    "unit_amount": amount,
                }
            )
    return rows


def seed_demo_prices(session: Session, effective_from: datetime) -> int:
    rows = demo_prices()
    for row in rows:
        create_price(session, **row, effective_from=effective_from)
    return len(rows)
