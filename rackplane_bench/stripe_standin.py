"""A local stand-in for the Stripe endpoints Rackplane uses, for tests and benchmarks (nothing
reaches the internet). It speaks Stripe's wire format (form-encoded requests, JSON answers and
errors), applies Stripe's documented validation rules, and records every call:

- `POST /v1/customers`: `Idempotency-Key` replays the first answer for the same key.
- `POST /v1/billing/meter_events`: `event_name` (required, at most 100 characters), `payload`
  with `stripe_customer_id` (a known customer) and `value` (an integer), `identifier` (at most
  100 characters, unique within 24 hours: a repeat is refused with `resource_already_exists`),
  `timestamp` (within the past 35 days or up to 5 minutes ahead). One call at a time per
  customer and meter: a concurrent one gets 429, and is counted as a violation.
- `POST /v1/billing/meter_event_adjustments`: `type=cancel` with `cancel[identifier]` of an
  event of that meter no more than 24 hours old.

`rate_limit_next` makes the next N meter calls answer 429 (to exercise back-off).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

DAY = 86_400


def unflatten(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """`payload[value]=1` -> {"payload": {"value": "1"}} (Stripe's form encoding)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        parts = re.findall(r"[^\[\]]+", key)
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


class StripeError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        self.status, self.code, self.message, self.param = status, code, message, param


@dataclass
class Event:
    identifier: str
    event_name: str
    customer: str
    value: int
    timestamp: int
    created: float
    cancelled: bool = False


@dataclass
class StandIn:
    clock: Any = time.time
    calls: list[dict[str, Any]] = field(default_factory=list)
    customers: dict[str, dict[str, Any]] = field(default_factory=dict)
    idempotent: dict[str, tuple[int, dict]] = field(default_factory=dict)
    events: dict[str, Event] = field(default_factory=dict)
    duplicates: int = 0
    concurrency_violations: int = 0
    rate_limit_next: int = 0
    delay: float = 0.0
    in_flight: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.customers.clear()
            self.idempotent.clear()
            self.events.clear()
            self.duplicates = self.concurrency_violations = self.rate_limit_next = 0
            self.delay = 0.0

    # --- what the tests read ------------------------------------------------------------------

    def totals(self) -> dict[tuple[str, str], int]:
        """Accepted, uncancelled value per (customer, meter)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for e in self.events.values():
            if not e.cancelled:
                out[(e.customer, e.event_name)] += e.value
        return dict(out)

    def accepted(self, path: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"] == path and c["status"] == 200]

    # --- the endpoints -------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers, body: dict[str, Any]) -> tuple[int, dict]:
        if not (headers.get("Authorization") or "").startswith("Bearer sk_"):
            raise StripeError(401, "api_key_invalid", "Invalid API Key provided.")
        if method == "POST" and path == "/v1/customers":
            return self._customer(headers, body)
        if method == "POST" and path == "/v1/billing/meter_events":
            return self._meter_event(body)
        if method == "POST" and path == "/v1/billing/meter_event_adjustments":
            return self._adjustment(body)
        raise StripeError(404, "resource_missing", f"Unrecognized request URL ({method} {path}).")

    def _customer(self, headers, body: dict[str, Any]) -> tuple[int, dict]:
        key = headers.get("Idempotency-Key")
        with self.lock:
            if key and key in self.idempotent:
                return self.idempotent[key]
            if len(body.get("email", "")) > 512 or len(body.get("name", "")) > 256:
                raise StripeError(400, "parameter_invalid_string", "Too long.", "email")
            cid = "cus_" + secrets.token_hex(7)
            obj = {
                "id": cid,
                "object": "customer",
                "name": body.get("name"),
                "email": body.get("email"),
                "metadata": body.get("metadata", {}),
                "created": int(self.clock()),
                "livemode": False,
            }
            self.customers[cid] = obj
            if key:
                self.idempotent[key] = (200, obj)
            return 200, obj

    def _meter_event(self, body: dict[str, Any]) -> tuple[int, dict]:
        now = self.clock()
        name = body.get("event_name") or ""
        if not name:
            raise StripeError(400, "parameter_missing", "Missing event_name.", "event_name")
        if len(name) > 100:
            raise StripeError(400, "parameter_invalid_string", "event_name too long.", "event_name")
        payload = body.get("payload") or {}
        customer = payload.get("stripe_customer_id")
        if customer not in self.customers:
            raise StripeError(400, "resource_missing", f"No such customer: {customer!r}", "payload")
        value = payload.get("value", "")
        if not re.fullmatch(r"\d+", value):
            raise StripeError(400, "parameter_invalid_integer", "value must be an integer.")
        ident = body.get("identifier") or ""
        if not ident or len(ident) > 100:
            raise StripeError(400, "parameter_invalid_string", "identifier: 1-100 characters.")
        ts_raw = body.get("timestamp", str(int(now)))
        if not re.fullmatch(r"\d+", ts_raw):
            raise StripeError(400, "parameter_invalid_integer", "timestamp must be an integer.")
        ts = int(ts_raw)
        if ts < now - 35 * DAY or ts > now + 300:
            raise StripeError(
                400,
                "parameter_invalid_integer",
                "timestamp must be within the past 35 days or up to 5 minutes in the future.",
                "timestamp",
            )
        slot = (customer, name)
        with self.lock:
            if self.rate_limit_next > 0:
                self.rate_limit_next -= 1
                raise StripeError(429, "rate_limit", "Too many requests.")
            if self.in_flight[slot]:
                self.concurrency_violations += 1
                raise StripeError(429, "rate_limit", "Concurrent calls for one customer and meter.")
            self.in_flight[slot] += 1
        try:
            if self.delay:
                time.sleep(self.delay)
            with self.lock:
                seen = self.events.get(ident)
                if seen is not None and now - seen.created < DAY:
                    self.duplicates += 1
                    raise StripeError(
                        400,
                        "resource_already_exists",
                        f"An event with identifier {ident} already exists.",
                        "identifier",
                    )
                self.events[ident] = Event(ident, name, customer, int(value), ts, now)
        finally:
            with self.lock:
                self.in_flight[slot] -= 1
        return 200, {
            "object": "billing.meter_event",
            "created": int(now),
            "event_name": name,
            "identifier": ident,
            "livemode": False,
            "payload": payload,
            "timestamp": ts,
        }

    def _adjustment(self, body: dict[str, Any]) -> tuple[int, dict]:
        now = self.clock()
        if body.get("type") != "cancel":
            raise StripeError(400, "parameter_invalid_string", "type must be cancel.", "type")
        ident = (body.get("cancel") or {}).get("identifier", "")
        with self.lock:
            e = self.events.get(ident)
            if e is None or e.event_name != body.get("event_name"):
                raise StripeError(400, "resource_missing", f"No event {ident!r} for that meter.")
            if now - e.created > DAY:
                raise StripeError(400, "parameter_invalid_string", "Too old to cancel.")
            e.cancelled = True
        return 200, {
            "object": "billing.meter_event_adjustment",
            "event_name": e.event_name,
            "livemode": False,
            "status": "pending",
            "type": "cancel",
            "cancel": {"identifier": ident},
        }


def serve(state: StandIn) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            body = unflatten(parse_qsl(raw, keep_blank_values=True))
            try:
                status, out = state.handle("POST", self.path, self.headers, body)
            except StripeError as exc:
                status = exc.status
                out = {
                    "error": {
                        "type": "invalid_request_error",
                        "code": exc.code,
                        "message": exc.message,
                        "param": exc.param,
                    }
                }
            with state.lock:
                state.calls.append(
                    {
                        "path": self.path,
                        "status": status,
                        "body": body,
                        "version": self.headers.get("Stripe-Version"),
                        "idempotency_key": self.headers.get("Idempotency-Key"),
                    }
                )
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Request-Id", "req_" + secrets.token_hex(6))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
