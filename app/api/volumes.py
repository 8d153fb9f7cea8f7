"""/v1/volumes: a tenant's volumes (app/workloads/volumes.py), by name: directories its runs
mount (a workload's `volumes`), on each node's disk or on the fleet's shared storage."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Response

from app.core.routing import DbSession, api_router
from app.core.schemas import RESOURCE_NAME_PATTERN, Page, PageParams
from app.models.workloads import Volume
from app.tenancy.auth import TenantRead, TenantWrite
from app.workloads.replies import VolumeOut
from app.workloads.schemas import VolumePut
from app.workloads.volumes import delete_volume, get_volume, list_volumes, put_volume

router = api_router(prefix="/v1", tags=["volumes"])

VolumeName = Annotated[
    str,
    Path(
        pattern=RESOURCE_NAME_PATTERN,
        description="The volume's name: letters, digits, `.`, `_` and `-` (1 to 63)",
    ),
]


@router.get("/volumes", response_model=Page[VolumeOut], summary="List your volumes")
def list_all(*, page: PageParams = Depends(), auth: TenantRead, session: DbSession) -> dict:
    items, nxt = list_volumes(session, auth, page)
    return {"items": items, "next_cursor": nxt}


@router.put(
    "/volumes/{volume_name}",
    response_model=VolumeOut,
    responses={201: {"model": VolumeOut, "description": "Created"}},
    summary="Make a volume (201 when new, 200 when it is there already; 409 "
    "`volume_storage_fixed` for other storage)",
)
def put(
    volume_name: VolumeName,
    body: VolumePut,
    auth: TenantWrite,
    session: DbSession,
    response: Response,
) -> Volume:
    assert auth.tenant_id is not None
    row, created = put_volume(session, auth.tenant_id, volume_name, body.storage)
    response.status_code = 201 if created else 200
    return row


@router.get("/volumes/{volume_name}", response_model=VolumeOut, summary="Read a volume")
def read(volume_name: VolumeName, auth: TenantRead, session: DbSession) -> Volume:
    return get_volume(session, auth, volume_name)


@router.delete(
    "/volumes/{volume_name}",
    status_code=204,
    summary="Delete a volume (409 `volume_in_use` while a workload that has not ended mounts it)",
)
def delete(volume_name: VolumeName, auth: TenantWrite, session: DbSession) -> None:
    delete_volume(session, auth, volume_name)
