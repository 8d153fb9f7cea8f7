"""Tenants' secrets: values (tokens, passwords) a workload's processes get as environment
variables by reference (`secret_env: {VAR: secret name}`), so that no workload read, event or
log shows them. Stored sealed with the server's secret key (app/core/secrets.py), bound to the
tenant and the name; no route returns a value: the only reader is the node that starts a run,
through that run's environment (app/agents/runs.py `run_env`). REST (/v1/secrets), GraphQL
(`secrets`, `putSecret`, `deleteSecret`) and the CLI (`rackplane secrets`) call these."""

from __future__ import annotations

import re
import uuid

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import Conflict, NotFound, ServiceUnavailable
from app.core.logging import get_logger
from app.core.schemas import RESOURCE_NAME_PATTERN, PageParams, paginate
from app.core.secrets import seal, unseal
from app.models.keys import TenantSecret
from app.models.workloads import Workload
from app.scheduling.lifecycle import TERMINAL
from app.tenancy.scoping import Owner, restrict, scoped_select

_PURPOSE = "tenant-secret"
log = get_logger(__name__)


def _context(tenant_id: uuid.UUID, name: str) -> bytes:
    return f"{tenant_id}:{name}".encode()


def put_secret(
    session: Session, tenant_id: uuid.UUID, name: str, value: str
) -> tuple[TenantSecret, bool]:
    """Set the tenant's secret `name` to `value` (a new one, or a new version of it: runs
    that start from now on get the new value; running ones keep theirs). Whether it is new."""
    now = utcnow()
    data = value.encode()
    row = session.scalar(
        restrict(
            tenant_id, select(TenantSecret).where(TenantSecret.name == name), TenantSecret
        ).with_for_update()
    )
    if row is not None:
        row.sealed = seal(_PURPOSE, data, _context(tenant_id, name))
        row.size, row.version, row.updated_at = len(data), row.version + 1, now
        session.flush()
        return row, False
    row = TenantSecret(
        tenant_id=tenant_id,
        name=name,
        sealed=seal(_PURPOSE, data, _context(tenant_id, name)),
        size=len(data),
        version=1,
        created_at=now,
        updated_at=now,
    )
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:
        raise Conflict(
            "The request conflicts with a concurrent change; nothing was written.",
            code="concurrent_update",
        ) from None
    return row, True


def list_secrets(
    session: Session, owner: Owner, page: PageParams
) -> tuple[list[TenantSecret], str | None]:
    """The secrets `owner` may see (names and sizes, never values), oldest first."""
    return paginate(session, scoped_select(owner, TenantSecret), TenantSecret, page)


def get_secret(
    session: Session, owner: Owner, name: str, *, for_update: bool = False
) -> TenantSecret:
    """One of `owner`'s secrets by name (a caller: its tenant's; a tenant id: that tenant's,
    as the CLI chooses); 404 `secret_not_found` otherwise (a name none could have too)."""
    if re.fullmatch(RESOURCE_NAME_PATTERN, name) is None:
        raise NotFound("No secret has that name.", code="secret_not_found")
    stmt = scoped_select(owner, TenantSecret).where(TenantSecret.name == name)
    row = session.scalar(stmt.with_for_update() if for_update else stmt)
    if row is None:
        raise NotFound(f"You have no secret named {name!r}.", code="secret_not_found")
    return row


class SecretInUse(Conflict):
    code = "secret_in_use"
    title = "The secret is in use"


def delete_secret(session: Session, owner: Owner, name: str) -> TenantSecret:
    """Delete a secret; 409 `secret_in_use` while a workload that has not ended names it (its
    next run could not start), naming them."""
    row = get_secret(session, owner, name, for_update=True)
    users = [
        w_id
        for w_id, refs in session.execute(
            select(Workload.id, Workload.secret_env).where(
                Workload.tenant_id == row.tenant_id,
                Workload.state.not_in([s.value for s in TERMINAL]),
            )
        )
        if name in (refs or {}).values()
    ]
    if users:
        shown = ", ".join(str(u) for u in users[:5]) + (" ..." if len(users) > 5 else "")
        raise SecretInUse(
            f"{len(users)} workload(s) that have not ended name secret {name!r} in their "
            f"secret_env ({shown}); terminate them first, or replace its value instead.",
            workloads=[str(u) for u in users[:50]],
        )
    session.delete(row)
    session.flush()
    return row


def secret_values(session: Session, tenant_id: uuid.UUID, refs: dict[str, str]) -> dict[str, str]:
    """The environment a run gets from the tenant's secrets: {VAR: value} for `refs` ({VAR:
    secret name}). A secret gone since (its row deleted behind the API's back: the API refuses
    to delete one in use) is the workload's to answer for: `SecretUnavailable`. One that no
    longer opens (`RACKPLANE_SECRET_KEY` changed, or differs between API hosts) is the
    operator's: logged, and `SecretsSealedAway` (503: the agent asks again later)."""
    if not refs:
        return {}
    rows = {
        r.name: r
        for r in session.scalars(
            restrict(
                tenant_id,
                select(TenantSecret).where(TenantSecret.name.in_(set(refs.values()))),
                TenantSecret,
            )
        )
    }
    out: dict[str, str] = {}
    for var, name in refs.items():
        row = rows.get(name)
        if row is None:
            raise SecretUnavailable(f"secret {name!r} (for {var}) is gone", secret=name)
        plain = unseal(_PURPOSE, row.sealed, _context(tenant_id, name))
        if plain is None:
            log.error("tenant_secret_unsealable", tenant=str(tenant_id), secret=name)
            raise SecretsSealedAway(
                "A secret this run needs cannot be opened with this server's secret key "
                "(RACKPLANE_SECRET_KEY changed, or differs between API hosts); an operator must "
                "restore the key, or the tenant set the secret again."
            )
        out[var] = plain.decode()
    return out


class SecretsSealedAway(ServiceUnavailable):
    code = "secret_unsealable"


class SecretUnavailable(Conflict):
    code = "secret_unavailable"
    title = "A secret the run needs is unavailable"
