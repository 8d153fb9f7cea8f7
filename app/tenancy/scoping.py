"""The one place tenancy is enforced for reads and writes of tenant-owned rows.

Every tenant-owned model names its owning column in `__tenant_column__`. Queries of such
models are built with `scoped_select`/`restrict`, and single objects are fetched with
`get_owned`, which answers 404 (never 403) for another tenant's object.
"""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from app.core.errors import NotFound
from app.tenancy.auth import AuthContext

M = TypeVar("M")


def _owner_column(model: Any):
    name = getattr(model, "__tenant_column__", None)
    if name is None:
        raise TypeError(f"{model.__name__} is not tenant-owned (no __tenant_column__)")
    return getattr(model, name)


def restrict(auth: AuthContext, stmt: Select, model: Any) -> Select:
    """Add the tenant filter for `model` to `stmt`. Operators (platform scope) see every tenant."""
    if auth.is_platform:
        return stmt
    if auth.tenant_id is None:  # defensive: a non-platform key always has a tenant
        return stmt.where(False)
    return stmt.where(_owner_column(model) == auth.tenant_id)


def scoped_select(auth: AuthContext, model: type[M]) -> Select[tuple[M]]:
    return restrict(auth, select(model), model)


def get_owned(
    session: Session,
    auth: AuthContext,
    model: type[M],
    obj_id: uuid.UUID | str,
    *,
    what: str | None = None,
    for_update: bool = False,
) -> M:
    """Fetch one tenant-owned object visible to `auth`, or raise 404. `for_update` locks its
    row for the rest of the transaction (concurrent writers of one object serialise)."""
    label = what or model.__name__.lower()
    try:
        oid = obj_id if isinstance(obj_id, uuid.UUID) else uuid.UUID(str(obj_id))
    except ValueError:
        raise NotFound(f"No {label} with id {obj_id!s}.", code=f"{label}_not_found") from None
    if for_update:
        stmt = scoped_select(auth, model).where(model.id == oid)  # type: ignore[attr-defined]
        obj = session.scalar(stmt.with_for_update())
    else:
        # By primary key (free when the session already holds it), then the same owner check
        # the filtered query would make.
        obj = session.get(model, oid)
        if obj is not None and not auth.is_platform:
            if getattr(obj, model.__tenant_column__) != auth.tenant_id:  # type: ignore[attr-defined]
                obj = None
    if obj is None:
        raise NotFound(f"No {label} with id {oid}.", code=f"{label}_not_found")
    return obj
