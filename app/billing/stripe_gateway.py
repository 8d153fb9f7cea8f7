"""The one module that talks to Stripe: the official SDK, a pinned API version, every call logged,
rate limits and connection errors retried with backoff (tenacity), Stripe's answers mapped to
what the exporter needs to decide.

Configured by `RACKPLANE_STRIPE_API_KEY` (no key: Stripe is off, and nothing is exported) and
`RACKPLANE_STRIPE_API_BASE` (tests and benchmarks point it at the stand-in server in
rackplane_bench/stripe_standin.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import stripe
from tenacity import (
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from app.core.config import get_settings
from app.core.logging import get_logger

log = get_logger(__name__)

# The API version every request sends (the stripe SDK pinned in pyproject.toml is built for it).
API_VERSION = "2026-10-28.endive"
RETRYABLE = (stripe.RateLimitError, stripe.APIConnectionError)


class AlreadyRecorded(Exception):
    """Stripe already holds a meter event with this identifier (a re-send after a crash)."""


class Rejected(Exception):
    """Stripe refused the request as invalid: sending it again would not help."""


@dataclass
class StripeGateway:
    api_key: str
    api_base: str | None = None
    max_attempts: int = 6

    def __post_init__(self) -> None:
        self.client = stripe.StripeClient(
            self.api_key,
            stripe_version=API_VERSION,
            base_addresses={"api": self.api_base} if self.api_base else None,
            max_network_retries=0,  # tenacity retries, so every attempt is logged here
        )
        self._call = retry(
            retry=retry_if_exception_type(RETRYABLE),
            wait=wait_exponential_jitter(multiplier=0.2, max=8.0, jitter=0.2),
            stop=stop_after_attempt(self.max_attempts),
            reraise=True,
        )(self._attempt)

    def _attempt(self, op: str, fn, params: dict[str, Any], options: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn(params, options or None)
        except stripe.StripeError as exc:
            log.warning(
                "stripe_call",
                op=op,
                ok=False,
                status=exc.http_status,
                code=exc.code,
                error=str(exc.user_message or exc)[:300],
                request_id=exc.request_id,
                ms=round(1000 * (time.perf_counter() - t0), 1),
            )
            raise
        log.info(
            "stripe_call",
            op=op,
            ok=True,
            id=getattr(out, "id", None) or getattr(out, "identifier", None),
            ms=round(1000 * (time.perf_counter() - t0), 1),
        )
        return out

    def _invoke(self, op: str, fn, params: dict[str, Any], **options: Any) -> Any:
        try:
            return self._call(op, fn, params, options)
        except stripe.InvalidRequestError as exc:
            if exc.code == "resource_already_exists":
                raise AlreadyRecorded(str(exc)) from exc
            raise Rejected(f"{exc.code}: {exc.user_message or exc}") from exc

    def create_customer(self, *, tenant_id: str, name: str, email: str) -> str:
        """The tenant's Stripe customer; the idempotency key makes a retried onboarding return
        the customer created the first time."""
        out = self._invoke(
            "customers.create",
            self.client.v1.customers.create,
            {"name": name, "email": email, "metadata": {"rackplane_tenant_id": tenant_id}},
            idempotency_key=f"rackplane-customer-{tenant_id}",
        )
        return out.id

    def meter_event(
        self, *, event_name: str, customer_id: str, value: int, identifier: str, timestamp: int
    ) -> None:
        self._invoke(
            "billing.meter_events.create",
            self.client.v1.billing.meter_events.create,
            {
                "event_name": event_name,
                "payload": {"stripe_customer_id": customer_id, "value": str(int(value))},
                "identifier": identifier,
                "timestamp": int(timestamp),
            },
        )

    def cancel_meter_event(self, *, event_name: str, identifier: str) -> None:
        self._invoke(
            "billing.meter_event_adjustments.create",
            self.client.v1.billing.meter_event_adjustments.create,
            {"event_name": event_name, "type": "cancel", "cancel": {"identifier": identifier}},
        )


def gateway() -> StripeGateway | None:
    """The configured gateway, or None when Stripe is off."""
    s = get_settings()
    if not s.stripe_api_key:
        return None
    return StripeGateway(s.stripe_api_key, s.stripe_api_base)
