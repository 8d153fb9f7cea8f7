"""Billing beat tasks."""

from __future__ import annotations

import uuid

from celery import shared_task

from app.billing import budgets, stripe_export
from app.billing.stripe_gateway import RETRYABLE, gateway
from app.core.db import RETRY_DB, session_scope
from app.models.tenants import Tenant


@shared_task(
    name="billing.budgets",
    ignore_result=True,
    autoretry_for=RETRY_DB,
    retry_backoff=True,
    max_retries=5,
)
def evaluate_budgets() -> int:
    """Bring every budget up to date; returns how many alerts were new."""
    with session_scope() as session:
        return len(budgets.evaluate(session))


@shared_task(
    name="billing.ensure_customer",
    ignore_result=True,
    autoretry_for=(*RETRY_DB, *RETRYABLE),
    retry_backoff=True,
    max_retries=10,
)
def ensure_customer(tenant_id: str) -> str | None:
    """Create the tenant's Stripe customer once (Stripe's idempotency key covers a crash
    between its answer and our commit) and keep its id on the tenant."""
    gw = gateway()
    if gw is None:
        return None
    with session_scope() as session:
        tenant = session.get(Tenant, uuid.UUID(tenant_id), with_for_update=True)
        if tenant is None or tenant.stripe_customer_id:
            return tenant.stripe_customer_id if tenant else None
        tenant.stripe_customer_id = gw.create_customer(
            tenant_id=str(tenant.id), name=tenant.name, email=tenant.contact_email
        )
        stripe_export.replan_all(session)  # its usage so far can now be sent
        return tenant.stripe_customer_id


@shared_task(
    name="billing.meter_export",
    ignore_result=True,
    autoretry_for=RETRY_DB,
    retry_backoff=True,
    max_retries=5,
)
def meter_export() -> dict:
    """Plan what the ledger owes Stripe, then send it (beat, every RACKPLANE_METER_EXPORT_EVERY)."""
    if gateway() is None:
        return {}
    with session_scope() as session:
        planned = stripe_export.plan(session)
    sent = stripe_export.send()
    return {"planned": planned.events, "cancels": planned.cancels, "sent": sent.sent}
