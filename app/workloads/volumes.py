"""Tenants' volumes: named directories their runs mount (`volumes` on a workload), on each
node's local disk (`node`) or on the fleet's shared storage (`shared`). The control plane keeps
the names; node agents make the directories, one per volume and tenant, closed to every other
tenant (rackplane_agent/volumes.py). REST (/v1/volumes), GraphQL (`volumes`, `putVolume`,
`deleteVolume`) and the CLI (`rackplane volumes`) call these."""

from __future__ import annotations

import re
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.db import utcnow
from app.core.errors import Conflict, NotFound, ValidationFailed
from app.core.schemas import RESOURCE_NAME_PATTERN, PageParams, paginate
from app.models.workloads import Volume, Workload
from app.scheduling.lifecycle import TERMINAL
from app.tenancy.scoping import Owner, restrict, scoped_select


class VolumeStorageFixed(Conflict):
    code = "volume_storage_fixed"
    title = "A volume's storage is fixed"


class VolumeInUse(Conflict):
    code = "volume_in_use"
    title = "The volume is in use"


def put_volume(
    session: Session, tenant_id: uuid.UUID, name: str, storage: str
) -> tuple[Volume, bool]:
    """Make the tenant's volume `name` (True), or answer the one it has (False); 409
    `volume_storage_fixed` when that one has other storage (its files are where they are)."""
    row = session.scalar(restrict(tenant_id, select(Volume).where(Volume.name == name), Volume))
    if row is not None:
        if row.storage != storage:
            raise VolumeStorageFixed(
                f"Volume {name!r} is on {row.storage} storage; its files stay there. Delete it "
                f"and make it again to have it on {storage} storage (it starts empty).",
                storage=row.storage,
            )
        return row, False
    row = Volume(tenant_id=tenant_id, name=name, storage=storage, created_at=utcnow())
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


def list_volumes(
    session: Session, owner: Owner, page: PageParams
) -> tuple[list[Volume], str | None]:
    return paginate(session, scoped_select(owner, Volume), Volume, page)


def get_volume(session: Session, owner: Owner, name: str, *, for_update: bool = False) -> Volume:
    """One of `owner`'s volumes by name; 404 `volume_not_found` otherwise."""
    if re.fullmatch(RESOURCE_NAME_PATTERN, name) is None:
        raise NotFound("No volume has that name.", code="volume_not_found")
    stmt = scoped_select(owner, Volume).where(Volume.name == name)
    row = session.scalar(stmt.with_for_update() if for_update else stmt)
    if row is None:
        raise NotFound(f"You have no volume named {name!r}.", code="volume_not_found")
    return row


def delete_volume(session: Session, owner: Owner, name: str) -> Volume:
    """Delete a volume; 409 `volume_in_use` while a workload that has not ended mounts it. Its
    directories on the nodes are not read again (a volume made again under its name has a new
    id, and so new, empty directories)."""
    row = get_volume(session, owner, name, for_update=True)
    users = [
        w_id
        for w_id, mounts in session.execute(
            select(Workload.id, Workload.volumes).where(
                Workload.tenant_id == row.tenant_id,
                Workload.state.not_in([s.value for s in TERMINAL]),
                Workload.volumes.is_not(None),
            )
        )
        if any(m.get("id") == str(row.id) for m in mounts or [])
    ]
    if users:
        shown = ", ".join(str(u) for u in users[:5]) + (" ..." if len(users) > 5 else "")
        raise VolumeInUse(
            f"{len(users)} workload(s) that have not ended mount volume {name!r} ({shown}); "
            "terminate them first.",
            workloads=[str(u) for u in users[:50]],
        )
    session.delete(row)
    session.flush()
    return row


def mounts(session: Session, tenant_id: Any, specs: list[Any]) -> list[dict] | None:
    """The mounts a submission asks for, resolved to the tenant's volumes ([{id, name,
    storage, mount_path, read_only}], as the workload stores them); 422 `unknown_volume`
    naming any the tenant does not have."""
    if not specs:
        return None
    names = sorted({s.name for s in specs})
    # Shared locks: a delete (which looks for live workloads mounting it) waits for this
    # submission's commit, and then sees it.
    stmt = scoped_select(tenant_id, Volume).where(Volume.name.in_(names))
    found = {v.name: v for v in session.scalars(stmt.with_for_update(read=True))}
    missing = [n for n in names if n not in found]
    if missing:
        raise ValidationFailed(
            f"You have no volume named {', '.join(map(repr, missing))}; make one at "
            "PUT /v1/volumes/{name}, or list yours at GET /v1/volumes.",
            code="unknown_volume",
            field="volumes",
        )
    return [
        {
            "id": str(found[s.name].id),
            "name": s.name,
            "storage": found[s.name].storage,
            "mount_path": s.mount_path.rstrip("/"),
            "read_only": s.read_only,
        }
        for s in specs
    ]

