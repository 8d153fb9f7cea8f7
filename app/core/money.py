"""Money as people read it: integer minor units shown in their currency ("$38,137.84")."""

from __future__ import annotations

from decimal import Decimal

# ISO 4217 currencies without minor units (Stripe's zero-decimal list); the rest have two.
ZERO_DECIMAL = frozenset("bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf".split())
SYMBOLS = {"usd": "$", "eur": "€", "gbp": "£", "jpy": "¥", "cad": "CA$", "aud": "A$"}


def exponent(currency: str) -> int:
    return 0 if currency.lower() in ZERO_DECIMAL else 2


def format_money(minor: int, currency: str) -> str:
    """`3813784, "usd"` -> `$38,137.84`; a currency without a symbol here is named after it
    (`1,234.50 CHF`)."""
    digits = exponent(currency)
    amount = Decimal(minor).scaleb(-digits)
    text = f"{abs(amount):,.{digits}f}"
    sign = "-" if minor < 0 else ""
    symbol = SYMBOLS.get(currency.lower())
    return f"{sign}{symbol}{text}" if symbol else f"{sign}{text} {currency.upper()}"
