from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from app.core.db import utcnow
from app.core.schemas import NO_NUL_PATTERN, RESOURCE_NAME_PATTERN, OutModel, StrictModel

TenantScope = Literal["read", "write", "admin", "invoke"]


class KeyCreate(StrictModel):
    name: str = Field(..., min_length=1, max_length=200)
    scopes: list[TenantScope] = Field(default_factory=lambda: ["read", "write"], min_length=1)
    expires_at: datetime | None = Field(
        None, description="Optional expiry (RFC 3339, with offset)."
    )

    @field_validator("scopes")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("expires_at")
    @classmethod
    def _future(cls, v: datetime | None) -> datetime | None:
        if v is not None:
            if v.tzinfo is None:
                raise ValueError("expires_at needs a timezone offset")
            if v <= utcnow():
                raise ValueError("expires_at must be in the future")
        return v


class KeyOut(OutModel):
    id: uuid.UUID
    tenant_id: uuid.UUID | None
    name: str
    prefix: str = Field(description="Public id of the key: the 8 characters after `rp_`.")
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="The secret API key. Shown once; only a hash is stored.")


class SignupKey(KeyOut):
    key: str | None = Field(
        description="The secret API key, shown once. Null when an `Idempotency-Key` replays the "
        "signup: a replay proves nothing about who sends it, so it never repeats a secret."
    )


# SSH keys (app/keys/ssh.py reads the key; app/keys/ssh_keys.py stores it).
SSH_KEY_NAME_PATTERN = RESOURCE_NAME_PATTERN


class SshKeyCreate(StrictModel):
    """A public key to put on the instances you launch."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=63,
        pattern=SSH_KEY_NAME_PATTERN,
        description="Unique in your account: letters, digits, `.`, `_` and `-` (1 to 63).",
        examples=["laptop"],
    )
    public_key: str = Field(
        ...,
        min_length=1,
        max_length=16384,
        pattern=NO_NUL_PATTERN,
        description="One OpenSSH public key line, `TYPE BASE64 [comment]` (the .pub file; "
        "a trailing line break is fine): ssh-ed25519, ecdsa-sha2-nistp256/384/521, or ssh-rsa "
        "of at least 3072 bits. A private key is refused (`ssh_key_is_private`) and never "
        "stored.",
        examples=[
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ5iA8uFQRe8LONmOliguTQz30Ci7m5MdD8vNqn6iyx3"
            " me@laptop"
        ],
    )

    @field_validator("*", mode="before")
    @classmethod
    def _json_values(cls, value: Any, info: ValidationInfo) -> Any:
        """As every body's text (JSON strings, no NUL), except that the key may end with the
        line break its .pub file has: it is read, not stored, as sent (app/keys/ssh.py)."""
        if not isinstance(value, str):
            raise ValueError("must be a string")
        if "\x00" in value:
            raise ValueError("text may not contain the NUL character (U+0000)")
        return value


class SshKeyOut(OutModel):
    id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    key_type: str = Field(description="ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa.")
    bits: int = Field(description="The key's size, as `ssh-keygen -l` prints it.")
    public_key: str = Field(description="`TYPE BASE64`, normalised (the comment is apart).")
    comment: str | None = Field(description="The comment that followed the key, if any.")
    fingerprint: str = Field(description="As `ssh-keygen -l` prints it: `SHA256:...`.")
    created_at: datetime


# Tenant secrets (app/keys/tenant_secrets.py).
MAX_SECRET_BYTES = 16384


class SecretPut(StrictModel):
    """A secret's value: given to the workloads that name it as an environment variable's
    value, never returned."""

    value: str = Field(
        ...,
        min_length=1,
        max_length=MAX_SECRET_BYTES,
        pattern=NO_NUL_PATTERN,
        description=f"The value (1 to {MAX_SECRET_BYTES} characters, no NUL). Stored sealed; "
        "no route returns it.",
    )


class SecretOut(OutModel):
    """A secret as the API shows it: everything but its value."""

    id: uuid.UUID
    name: str
    size: int = Field(description="Bytes in its value (UTF-8)")
    version: int = Field(description="1, then one more each time its value is replaced")
    created_at: datetime
    updated_at: datetime


class SecretSet(SecretPut):
    """A secret's name and value together (GraphQL's `putSecret`; REST names it in the path)."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=63,
        pattern=RESOURCE_NAME_PATTERN,
        description="Unique in your account: letters, digits, `.`, `_` and `-` (1 to 63).",
        examples=["hf-token"],
    )
