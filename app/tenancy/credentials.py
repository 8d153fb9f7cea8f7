"""Credentials: API keys and browser-session tokens made, hashed and compared (with the
server's pepper), never stored in the clear."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string

from app.core.secrets import server_secret

KEY_PREFIX = "rp_"

PREFIX_LEN = 8

SECRET_LEN = 40

_ALPHABET = string.ascii_letters + string.digits


def generate_key() -> tuple[str, str, str]:
    """Return (full key, public prefix, secret hash). The full key is shown once, never stored."""
    prefix = "".join(secrets.choice(_ALPHABET) for _ in range(PREFIX_LEN))
    secret = "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LEN))
    full = f"{KEY_PREFIX}{prefix}{secret}"
    return full, prefix, hash_secret(full)


def hash_secret(full_key: str) -> str:
    return hmac.new(server_secret("key_pepper"), full_key.encode(), hashlib.sha256).hexdigest()


def parse_prefix(full_key: str) -> str | None:
    if (
        not full_key.startswith(KEY_PREFIX)
        or len(full_key) != len(KEY_PREFIX) + PREFIX_LEN + SECRET_LEN
    ):
        return None
    if not all(c in _ALPHABET for c in full_key[len(KEY_PREFIX) :]):
        return None
    return full_key[len(KEY_PREFIX) : len(KEY_PREFIX) + PREFIX_LEN]


SESSION_PREFIX = "rps_"


def session_hash(token: str) -> str:
    return hmac.new(
        server_secret("key_pepper"), b"session:" + token.encode(), hashlib.sha256
    ).hexdigest()


def csrf_token(token: str) -> str:
    """The session's CSRF token: derived from its secret, so nothing more is stored."""
    return hmac.new(
        server_secret("key_pepper"), b"csrf:" + token.encode(), hashlib.sha256
    ).hexdigest()
