"""Server secrets: the pepper mixed into API-key hashes and the key that encrypts what the server
keeps of responses (idempotency records).

Each comes from its environment variable. On the embedded default (SQLite) a missing one is
generated once and kept in the data directory (mode 0600), beside the database it protects, so
`make run` works on a fresh machine and keeps working across restarts. On PostgreSQL a missing
one is a refusal to start: a production database must not silently run with an empty pepper,
and a secret generated on one API host would differ from the next host's.
"""

from __future__ import annotations

import os
import secrets
from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from app.core.config import get_settings

# name -> (settings attribute, environment variable)
SECRETS = {
    "key_pepper": "RACKPLANE_KEY_PEPPER",
    "secret_key": "RACKPLANE_SECRET_KEY",
}
MIN_LENGTH = 16


class MissingSecret(RuntimeError):
    """A server secret is not configured where it cannot be generated."""


def server_secret(name: str) -> bytes:
    """The secret's bytes (see the module)."""
    return _secret(name, get_settings().sqlalchemy_url)


@lru_cache
def _secret(name: str, _url: str) -> bytes:
    env = SECRETS[name]
    settings = get_settings()
    value = getattr(settings, name)
    if value:
        if len(value) < MIN_LENGTH:
            raise MissingSecret(f"{env} must be at least {MIN_LENGTH} characters long.")
        return value.encode()
    if not settings.is_sqlite:
        raise MissingSecret(
            f"{env} is not set. On PostgreSQL Rackplane will not start without it: set the same "
            "value on every API and worker host (for example the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`) and keep it: "
            + (
                "changing the pepper invalidates every API key."
                if name == "key_pepper"
                else "changing it makes stored Idempotency-Key results unreadable (they are "
                "then forgotten, as if expired)."
            )
        )
    folder = settings.data_dir / "secrets"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / name
    try:  # O_EXCL: two processes starting at once agree on the first one written
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_urlsafe(32).encode())
    return path.read_bytes().strip()


def check_server_secrets() -> None:
    """Raise MissingSecret unless every server secret is available (called at start-up)."""
    for name in SECRETS:
        server_secret(name)


def _aead(purpose: str) -> AESGCM:
    return _aead_for(purpose, server_secret("secret_key"))


@lru_cache
def _aead_for(purpose: str, secret: bytes) -> AESGCM:
    key = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=f"rackplane:{purpose}".encode()
    ).derive(secret)
    return AESGCM(key)


def seal(purpose: str, plaintext: bytes, context: bytes) -> bytes:
    """Encrypt and authenticate `plaintext`, bound to `context` (a row cannot be moved to
    another owner and still open)."""
    nonce = secrets.token_bytes(12)
    return nonce + _aead(purpose).encrypt(nonce, plaintext, context)


def unseal(purpose: str, sealed: bytes, context: bytes) -> bytes | None:
    """The plaintext, or None when it cannot be opened (another key, another context)."""
    from cryptography.exceptions import InvalidTag

    try:
        return _aead(purpose).decrypt(sealed[:12], sealed[12:], context)
    except (InvalidTag, ValueError):
        return None
