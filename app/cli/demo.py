"""The demo `rackplane up` seeds on an empty database: the demo fleet, a tenant with its key,
quotas, budget and work, an operator key, and a price book."""

from __future__ import annotations

from sqlalchemy import func, select

from app.billing.budgets import set_budget
from app.billing.demo_prices import seed_demo_prices
from app.cli.common import DEMO_FLEET, err
from app.core.db import session_scope, utcnow
from app.core.errors import AppError
from app.fleet import document
from app.fleet.service import apply_document
from app.keys.service import create_key
from app.models.keys import ApiKey
from app.models.tenants import Tenant
from app.tenancy.principals import key_context
from app.tenants.service import create_tenant
from app.workloads import service as workloads
from app.workloads.quotas import set_quotas
from app.workloads.schemas import QuotaIn, WorkloadCreate

# The demo tenant's quotas, budget and work, so the portal has something to show from the first
# start: gangs on the NVL72 rack and the H200s, a MIG notebook, a fractional inference share, a
# VM, and a gang that waits. None of it touches the H100s (the README's walkthrough uses them).
DEMO_QUOTAS = [
    {"gpu_model": "GB200", "guaranteed_milli": 36_000, "limit_milli": 72_000},
    {"gpu_model": "H200-141GB", "guaranteed_milli": 8_000, "limit_milli": 32_000},
    {"gpu_model": "B200", "guaranteed_milli": 4_000, "limit_milli": 16_000},
    {"gpu_model": "A100-80GB", "guaranteed_milli": 2_000},
]
DEMO_WORK = [
    {
        "name": "llm-pretrain",
        "kind": "job",
        "replicas": 4,
        "gpus": 4,
        "gpu_models": ["GB200"],
        "topology": {"level": "nvlink_domain", "mode": "required"},
        "run_for_s": 8 * 3600,
        "checkpoint": {"interval_s": 900, "cost_s": 30},
    },
    {
        "name": "finetune-h200",
        "kind": "job",
        "replicas": 2,
        "gpus": 8,
        "gpu_models": ["H200-141GB"],
        "topology": {"level": "rack", "mode": "preferred"},
        "run_for_s": 4 * 3600,
    },
    {
        "name": "notebook",
        "kind": "instance",
        "mig_profile": "1g.10gb",
        "gpu_models": ["A100-80GB"],
        "run_for_s": 2 * 3600,
        "priority": "research",
    },
    {
        "name": "inference",
        "kind": "instance",
        "milli": 500,
        "gpu_memory_mib": 20_000,
        "gpu_models": ["B200"],
        "run_for_s": 6 * 3600,
        "priority": "production",
    },
    {
        "name": "batch-vm",
        "kind": "vm",
        "gpus": 2,
        "gpu_models": ["B200"],
        "run_for_s": 3 * 3600,
        "priority": "research",
    },
    {
        "name": "eval-h200",
        "kind": "job",
        "replicas": 2,
        "gpus": 8,
        "gpu_models": ["H200-141GB"],
        "run_for_s": 3600,
        "priority": "research",
    },
]


def seed_demo() -> dict | None:
    """On an empty database: the demo fleet, a demo tenant and its key, and an operator key."""
    with session_scope() as session:
        if session.scalar(select(func.count()).select_from(Tenant)):
            return None
        apply_document(session, document.load(DEMO_FLEET.read_text()))
        tenant = create_tenant(
            session, name="Demo Tenant", slug="demo", contact_email="demo@example.com"
        )
        tkey = create_key(
            session, tenant_id=tenant.id, name="demo", scopes=["read", "write", "admin"]
        )
        okey = create_key(session, tenant_id=None, name="operator", scopes=["platform"])
        # A price book from the start of the month, so the demo's usage is billed.
        now = utcnow()
        seed_demo_prices(session, now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
        _seed_demo_work(session, tenant, tkey)
        return {"tenant_key": tkey.key, "operator_key": okey.key}


def _seed_demo_work(session, tenant, key) -> None:
    """Through the service, as the tenant's own requests would go (refusals are logged, not
    fatal: the demo starts whatever the catalogue says)."""
    set_quotas(session, tenant.id, [QuotaIn(**q) for q in DEMO_QUOTAS])
    set_budget(session, tenant.id, currency="usd", spend_limit=2_000_000)  # $20,000 a month
    auth, _ = key_context(session, session.get(ApiKey, key.id), tenant, utcnow())
    for spec in DEMO_WORK:
        try:
            with session.begin_nested():
                workloads.submit(session, auth, WorkloadCreate(**spec))
        except (AppError, ValueError) as e:
            err.print(f"[yellow]demo workload {spec['name']} not submitted:[/yellow] {e}")
