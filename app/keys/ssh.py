"""Reading an SSH public key as a tenant pastes it (`~/.ssh/id_ed25519.pub`: one line,
`TYPE BASE64 [comment]`), and refusing what we will not put on an instance.

Accepted: ssh-ed25519, ecdsa-sha2-nistp256/384/521, and ssh-rsa of 3072 bits or more (NIST's
floor past 2030; OpenSSH's own limit, 16384, is the ceiling). Refused, each with its code:
RSA under 3072 bits (`ssh_key_too_weak`); DSA and every other type, certificates and
security-key types included (`ssh_key_type_unsupported`); text that is not a public key
(`ssh_key_invalid`); and a private key (`ssh_key_is_private`), detected before anything else
reads the text so that it reaches neither a parser's message, nor a log, nor the answer.

The key is parsed by `cryptography` (already a dependency) after the wire format's own type
name is checked against the line's, and stored normalised: `TYPE BASE64` re-encoded from the
decoded blob, the comment apart, and the fingerprint as `ssh-keygen -l` prints it
(`SHA256:` and the unpadded base64 of the blob's SHA-256).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import unicodedata
from dataclasses import dataclass

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from app.core.errors import ValidationFailed

MIN_RSA_BITS = 3072
MAX_RSA_BITS = 16384  # OpenSSH refuses larger moduli (SSH_RSA_MAXIMUM_MODULUS_SIZE)
MAX_COMMENT = 255
ACCEPTED = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
)
_CURVES = {
    "ecdsa-sha2-nistp256": ec.SECP256R1,
    "ecdsa-sha2-nistp384": ec.SECP384R1,
    "ecdsa-sha2-nistp521": ec.SECP521R1,
}
# What a private key's text carries: PEM and OpenSSH armour (`-----BEGIN OPENSSH PRIVATE
# KEY-----`, `RSA PRIVATE KEY`, `ENCRYPTED PRIVATE KEY`...) and PuTTY's .ppk header.
_PRIVATE_MARKS = ("PRIVATE KEY-----", "OPENSSH PRIVATE KEY", "PUTTY-USER-KEY-FILE-")
# A key type as OpenSSH names them (`ssh-dss`, `sk-ssh-ed25519@openssh.com`): only text of this
# shape is ever repeated back in a refusal.
_TYPE_NAME = re.compile(r"[a-z0-9][a-z0-9@.+-]{0,63}")
_ACCEPTED_TEXT = "ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa of at least 3072 bits"


class SshKeyRefused(ValidationFailed):
    """A public key we do not take (422, its code names why). Its detail never quotes the
    text sent beyond a key type name."""

    title = "SSH key refused"

    def __init__(self, detail: str, *, code: str):
        super().__init__(
            detail,
            code=code,
            # As REST's 422s name fields (GraphQL answers them as `["input", "publicKey"]`).
            errors=[{"field": "body.public_key", "message": detail, "type": code}],
        )


@dataclass(frozen=True)
class PublicKey:
    """A public key as stored: `public_key` is `TYPE BASE64` (no comment)."""

    key_type: str
    bits: int
    public_key: str
    comment: str | None
    fingerprint: str


def looks_private(text: str) -> bool:
    """Whether the text holds a private key (or a part of one's armour)."""
    upper = text.upper()
    return any(mark in upper for mark in _PRIVATE_MARKS)


def fingerprint(blob: bytes) -> str:
    """`ssh-keygen -l`'s fingerprint of a key's wire-format blob: `SHA256:...`."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _invalid(why: str = "") -> SshKeyRefused:
    return SshKeyRefused(
        "Not an OpenSSH public key"
        + (f" ({why})" if why else "")
        + ": paste one line, `TYPE BASE64 [comment]`, as in ~/.ssh/id_ed25519.pub.",
        code="ssh_key_invalid",
    )


def _unsupported(key_type: str) -> SshKeyRefused:
    why = " (DSA is obsolete: OpenSSH disabled it in 2015)" if key_type == "ssh-dss" else ""
    return SshKeyRefused(
        f"{key_type} keys are not accepted{why}; use {_ACCEPTED_TEXT} "
        "(ssh-keygen -t ed25519 makes one).",
        code="ssh_key_type_unsupported",
    )


def _wire_type(blob: bytes) -> str | None:
    """The key type named first in a wire-format blob (RFC 4253 §6.6), or None."""
    if len(blob) < 4:
        return None
    (n,) = struct.unpack(">I", blob[:4])
    if not 0 < n <= 64 or len(blob) < 4 + n:
        return None
    try:
        return blob[4 : 4 + n].decode("ascii")
    except UnicodeDecodeError:
        return None


def parse_public_key(text: str) -> PublicKey:
    """The public key in `text` (one OpenSSH line; blanks around it are ignored), or
    SshKeyRefused saying why not."""
    if looks_private(text):
        raise SshKeyRefused(
            "This is a private key; it was not stored. Paste the public key instead: the .pub "
            "file beside it (e.g. ~/.ssh/id_ed25519.pub, or `ssh-keygen -y -f KEYFILE`). Keep "
            "the private key to yourself; if it was pasted anywhere else, make a new one.",
            code="ssh_key_is_private",
        )
    line = text.strip()
    if not line:
        raise _invalid("it is empty")
    if "\n" in line or "\r" in line:
        raise _invalid("it is more than one line")
    parts = line.split(None, 2)
    if len(parts) < 2:
        raise _invalid()
    key_type, encoded = parts[0], parts[1]
    comment = parts[2].strip() if len(parts) == 3 else None
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid("its key is not base64") from None
    inner = _wire_type(blob)
    if inner is None:
        raise _invalid()
    if inner != key_type:
        raise _invalid("its type does not match the key's own")
    if key_type not in ACCEPTED:
        if _TYPE_NAME.fullmatch(key_type):
            raise _unsupported(key_type)
        raise _invalid()
    if comment is not None and len(comment) > MAX_COMMENT:
        raise _invalid(f"its comment is longer than {MAX_COMMENT} characters")
    if comment is not None and any(unicodedata.category(c) == "Cc" for c in comment):
        raise _invalid("its comment holds control characters")
    try:
        key = serialization.load_ssh_public_key(f"{key_type} {encoded}".encode("ascii"))
    except (ValueError, UnsupportedAlgorithm, struct.error):
        raise _invalid("its key does not decode") from None
    if key_type == "ssh-ed25519":
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise _invalid("its key does not decode")
        bits = 256
    elif key_type in _CURVES:
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(
            key.curve, _CURVES[key_type]
        ):
            raise _invalid("its curve does not match its type")
        bits = key.curve.key_size
    else:
        if not isinstance(key, rsa.RSAPublicKey):
            raise _invalid("its key does not decode")
        bits = key.key_size
        if bits < MIN_RSA_BITS:
            raise SshKeyRefused(
                f"This RSA key has {bits} bits; at least {MIN_RSA_BITS} are needed. Make an "
                "ed25519 key (ssh-keygen -t ed25519), or RSA of 4096 bits "
                "(ssh-keygen -t rsa -b 4096).",
                code="ssh_key_too_weak",
            )
        if bits > MAX_RSA_BITS:
            raise _invalid(f"RSA keys past {MAX_RSA_BITS} bits are refused by OpenSSH")
    return PublicKey(
        key_type=key_type,
        bits=bits,
        public_key=f"{key_type} {base64.b64encode(blob).decode()}",
        comment=comment or None,
        fingerprint=fingerprint(blob),
    )
