"""Volumes: the caller's, making one and deleting one, as REST's /v1/volumes routes (the same
service calls, the same error codes)."""

from __future__ import annotations

import strawberry

from app.graphql.context import Info
from app.graphql.pagination import Connection, connection, page_params
from app.graphql.permissions import TenantRead
from app.graphql.results import result_union, run_mutation
from app.graphql.views import input_view, parse, shape, view
from app.tenancy.principal import require_tenant_scope
from app.workloads import volumes
from app.workloads.replies import VolumeOut
from app.workloads.schemas import VolumeSet

Volume = view(VolumeOut, "Volume", "A volume of yours: a directory your runs mount")
VolumeInput = input_view(VolumeSet, "VolumeInput")
VolumeResult = result_union("VolumeResult", Volume)


@strawberry.type
class VolumeQuery:
    @strawberry.field(
        permission_classes=[TenantRead], description="Your volumes (REST: GET /v1/volumes)"
    )
    def volumes(self, info: Info, first: int = 50, after: str | None = None) -> Connection[Volume]:  # type: ignore[valid-type]
        rows, nxt = volumes.list_volumes(
            info.context.session, info.context.auth, page_params(first, after)
        )
        return connection(rows, lambda r: shape(VolumeOut, r), nxt)


@strawberry.type
class VolumeMutation:
    @strawberry.mutation(
        description="Make a volume (REST: PUT /v1/volumes/{name}); the one you have when it is "
        "there already, `volume_storage_fixed` when it has other storage"
    )
    def put_volume(self, info: Info, input: VolumeInput) -> VolumeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            body = parse(VolumeSet, input)
            row, _ = volumes.put_volume(ctx.session, ctx.auth.tenant_id, body.name, body.storage)
            return {"name": body.name, "storage": body.storage}, row, shape(VolumeOut, row)

        return run_mutation(info, "putVolume", act)

    @strawberry.mutation(
        description="Delete a volume (REST: DELETE /v1/volumes/{name}); `volume_in_use` while a "
        "workload that has not ended mounts it"
    )
    def delete_volume(self, info: Info, name: str) -> VolumeResult:  # type: ignore[valid-type]
        def act():
            ctx = info.context
            require_tenant_scope(ctx.auth, "write")
            row = volumes.delete_volume(ctx.session, ctx.auth, name)
            return {"name": name}, row, shape(VolumeOut, row)

        return run_mutation(info, "deleteVolume", act)
