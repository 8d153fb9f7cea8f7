"""Tenants' SSH keys: adding one (read and refused by app/keys/ssh.py first), listing and
deleting them. REST (/v1/ssh-keys), GraphQL (`sshKeys`, `addSshKey`, `deleteSshKey`) and the
CLI (`rackplane ssh-keys`) call these; tenancy is the scoping helper's."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import Conflict
from app.core.schemas import PageParams, paginate
from app.keys.ssh import parse_public_key
from app.models.keys import SshKey
from app.tenancy.principal import AuthContext
from app.tenancy.scoping import Owner, get_owned, restrict, scoped_select


def add_ssh_key(session: Session, *, tenant_id: uuid.UUID, name: str, public_key: str) -> SshKey:
    """Store a tenant's public key under `name`. Refused (422, nothing written) when it is not
    one we take, a private key above all (app/keys/ssh.py); 409 `ssh_key_name_taken` when the
    name is in use, 409 `ssh_key_exists` when the tenant has this key already (checked again
    when a concurrent request won the unique constraints' race)."""
    parsed = parse_public_key(public_key)
    _refuse_duplicates(session, tenant_id, name, parsed.fingerprint)
    key = SshKey(
        tenant_id=tenant_id,
        name=name,
        key_type=parsed.key_type,
        bits=parsed.bits,
        public_key=parsed.public_key,
        comment=parsed.comment,
        fingerprint=parsed.fingerprint,
        created_at=utcnow(),
    )
    try:
        with session.begin_nested():
            session.add(key)
            session.flush()
    except IntegrityError:
        _refuse_duplicates(session, tenant_id, name, parsed.fingerprint)
        raise Conflict(
            "The request conflicts with a concurrent change; nothing was written.",
            code="concurrent_update",
        ) from None
    return key


def _refuse_duplicates(session: Session, tenant_id: uuid.UUID, name: str, fingerprint: str) -> None:
    same_name = select(SshKey.id).where(SshKey.name == name)
    if session.scalar(restrict(tenant_id, same_name, SshKey)) is not None:
        raise Conflict(
            f"You have an SSH key named {name!r} already; pick another name, or delete that "
            "one first.",
            code="ssh_key_name_taken",
        )
    same_key = select(SshKey.name).where(SshKey.fingerprint == fingerprint)
    existing = session.scalar(restrict(tenant_id, same_key, SshKey))
    if existing is not None:
        raise Conflict(
            f"This key ({fingerprint}) is in your account already, as {existing!r}.",
            code="ssh_key_exists",
        )


def list_ssh_keys(
    session: Session, owner: Owner, page: PageParams
) -> tuple[list[SshKey], str | None]:
    """The SSH keys `owner` may read (a caller: its tenant's; a tenant id: that tenant's, as an
    operator or the CLI chooses), oldest first, a page at a time."""
    return paginate(session, scoped_select(owner, SshKey), SshKey, page)


def get_ssh_key(
    session: Session, auth: AuthContext, ssh_key_id: uuid.UUID | str, *, for_update: bool = False
) -> SshKey:
    """One SSH key `auth` may read; 404 `ssh_key_not_found` otherwise (another tenant's too)."""
    return get_owned(session, auth, SshKey, ssh_key_id, what="ssh_key", for_update=for_update)


def ssh_key_named(session: Session, tenant_id: uuid.UUID, name: str) -> SshKey | None:
    """A tenant's SSH key by its name (the CLI's handle), or None."""
    stmt = scoped_select(tenant_id, SshKey).where(SshKey.name == name)
    return session.scalar(stmt)


def delete_ssh_key(session: Session, key: SshKey) -> SshKey:
    """Delete an SSH key; answers it as it was."""
    session.delete(key)
    session.flush()
    return key
