"""The one place tenancy is enforced for reads and writes of tenant-owned rows.

Every tenant-owned model names its owning column in `__tenant_column__`. Every statement over
such a model is narrowed by `restrict` (or built by `scoped_select`, a select of the model so
narrowed), for a caller (its AuthContext) or for tenants named outright (an operator's or a
background job's choice); single objects are fetched with `get_owned`, which answers 404 (never
403) for another tenant's object. No tenant filter is written anywhere else.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any, TypeVar

from sqlalchemy import Delete, Select, Update, select
from sqlalchemy.orm import Session

from app.core.errors import NotFound
from app.tenancy.principal import AuthContext

M = TypeVar("M")
S = TypeVar("S", Select, Update, Delete)

# Whose rows a statement may touch: a caller's (its AuthContext), one tenant's (its id) or
# several tenants' (a collection of ids).
Owner = AuthContext | uuid.UUID | Collection[uuid.UUID]


def _owner_column(model: Any):
    name = getattr(model, "__tenant_column__", None)
    if name is None:
        raise TypeError(f"{model.__name__} is not tenant-owned (no __tenant_column__)")
    return getattr(model, name)


def restrict(owner: Owner, stmt: S, model: Any) -> S:
    """`stmt` narrowed to the rows of `model` that `owner` may touch (the one tenant filter).

    A caller: operators (platform scope) touch every tenant's rows, a tenant key its own, and
    a key that is neither nothing. A tenant id: that tenant's rows (None: rows of no tenant).
    A collection of tenant ids: those tenants' rows."""
    if isinstance(owner, AuthContext):
        if owner.is_platform:
            return stmt
        if owner.tenant_id is None:  # defensive: a non-platform key always has a tenant
            return stmt.where(False)
        return stmt.where(_owner_column(model) == owner.tenant_id)
    if isinstance(owner, Collection) and not isinstance(owner, str):
        return stmt.where(_owner_column(model).in_(list(owner)))
    return stmt.where(_owner_column(model) == owner)


def scoped_select(owner: Owner, model: type[M]) -> Select[tuple[M]]:
    """A select of `model`'s rows that `owner` may read (see `restrict`)."""
    return restrict(owner, select(model), model)


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
