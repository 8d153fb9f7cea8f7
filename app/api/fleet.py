from __future__ import annotations

from fastapi import Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from app.agents import mig
from app.agents.schemas import MigLayoutIn, MigRelayoutOut
from app.core.config import get_settings
from app.core.db import get_or_404
from app.core.errors import PayloadTooLarge, ValidationFailed
from app.core.routing import DbSession, api_router
from app.core.schemas import Page, PageParams, text_query
from app.fleet import document
from app.fleet.schemas import (
    Capacity,
    FleetImportOut,
    FleetValidation,
    GpuDetail,
    GpuOut,
    NodeDetail,
    NodeOut,
    NodeStateChange,
    RackOut,
    RegionOut,
)
from app.fleet.service import (
    capacity,
    change_node_state,
    gpu_detail,
    holders,
    node_detail,
    queue_import,
    refuse_conflicts,
)
from app.fleet.service import list_gpus as gpus_page
from app.fleet.service import list_nodes as nodes_page
from app.fleet.service import list_racks as racks_page
from app.fleet.service import list_regions as regions_page
from app.models.fleet import FleetImport, Gpu, Node, NodeState, Rack
from app.tenancy.auth import Platform, TenantRead

router = api_router(prefix="/v1", tags=["capacity"])
admin = api_router(prefix="/v1/admin", tags=["admin: fleet"])

_IMPORT_BODY = {
    "requestBody": {
        "required": True,
        "description": "A fleet file (regions -> racks -> nodes), as YAML or JSON.",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/FleetDocument"}},
            "application/yaml": {"schema": {"$ref": "#/components/schemas/FleetDocument"}},
        },
    }
}


async def _raw_body(request: Request) -> bytes:
    raw = await request.body()
    if len(raw) > get_settings().max_import_bytes:
        raise PayloadTooLarge(
            f"Fleet files are limited to {get_settings().max_import_bytes} bytes."
        )
    return raw


@router.get("/capacity", response_model=Capacity, summary="Fleet capacity by region and GPU model")
def get_capacity(auth: TenantRead, session: DbSession) -> dict:
    return {"items": capacity(session)}


@admin.post(
    "/fleet:import",
    status_code=202,
    openapi_extra=_IMPORT_BODY,
    responses={200: {"model": FleetValidation, "description": "dry_run: the file is valid"}},
    response_model=FleetImportOut,
    summary="Import a fleet file (validated whole; applied by a worker)",
)
def import_fleet(
    *,
    request: Request,
    response: Response,
    raw: bytes = Depends(_raw_body),
    dry_run: bool = Query(False, description="Validate only; write nothing."),
    source: str | None = text_query(max_length=300, description="File name, for the record."),
    auth: Platform,
    session: DbSession,
):
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    fmt = "json" if ctype.endswith("json") else "yaml"
    try:
        doc = document.load(raw.decode("utf-8"), fmt=fmt)
    except UnicodeDecodeError:
        raise ValidationFailed(
            "The fleet file must be UTF-8 text.", code="invalid_fleet_file"
        ) from None
    except document.FleetDocumentError as exc:
        raise ValidationFailed(
            f"The fleet file has {len(exc.errors)} error(s); nothing was imported.",
            code="invalid_fleet_file",
            errors=exc.errors,
        ) from None
    # Checked against the fleet as it is now, dry run or not: a file the import would refuse
    # is refused here, with every conflict named (the worker checks again when it applies).
    refuse_conflicts(session, doc)
    if dry_run:
        return JSONResponse(
            FleetValidation(valid=True, totals=document.summarize(doc)).model_dump()
        )
    imp = queue_import(session, doc, source)
    response.headers["Location"] = f"/v1/admin/fleet/imports/{imp.id}"
    return FleetImportOut.model_validate(imp).model_dump(mode="json")


@admin.get(
    "/fleet/imports/{import_id}", response_model=FleetImportOut, summary="A fleet import's status"
)
def read_import(import_id: str, auth: Platform, session: DbSession) -> FleetImport:
    return get_or_404(session, FleetImport, import_id, what="fleet_import")


@admin.get("/regions", response_model=Page[RegionOut], summary="List regions")
def list_regions(*, page: PageParams = Depends(), auth: Platform, session: DbSession) -> dict:
    items, nxt = regions_page(session, page)
    return {"items": items, "next_cursor": nxt}


@admin.get("/racks", response_model=Page[RackOut], summary="List racks")
def list_racks(
    *,
    region_id: str | None = text_query(),
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = racks_page(session, page, region_id=region_id)
    return {"items": items, "next_cursor": nxt}


@admin.get("/racks/{rack_id}", response_model=RackOut, summary="Read a rack")
def read_rack(rack_id: str, auth: Platform, session: DbSession) -> Rack:
    return get_or_404(session, Rack, rack_id, what="rack")


@admin.get("/nodes", response_model=Page[NodeOut], summary="List nodes")
def list_nodes(
    *,
    rack_id: str | None = text_query(),
    state: NodeState | None = None,
    gpu_model: str | None = text_query(max_length=32),
    name: str | None = text_query(max_length=63, description="Node name"),
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = nodes_page(
        session,
        page,
        rack_id=rack_id,
        state=state.value if state else None,
        gpu_model=gpu_model,
        name=name,
    )
    return {"items": items, "next_cursor": nxt}


@admin.get("/nodes/{node_id}", response_model=NodeDetail, summary="Read a node and its GPUs")
def read_node(node_id: str, auth: Platform, session: DbSession) -> dict:
    return node_detail(session, get_or_404(session, Node, node_id, what="node"))


@admin.patch(
    "/nodes/{node_id}",
    response_model=NodeOut,
    summary="Change a node's state (cordon, drain, mark down, return to ready)",
)
def change_node(node_id: str, body: NodeStateChange, auth: Platform, session: DbSession) -> Node:
    node = get_or_404(session, Node, node_id, what="node")
    return change_node_state(session, node, body.state.value, body.reason)


@admin.get("/gpus", response_model=Page[GpuOut], summary="List GPUs")
def list_gpus(
    *,
    node_id: str | None = text_query(),
    page: PageParams = Depends(),
    auth: Platform,
    session: DbSession,
) -> dict:
    items, nxt = gpus_page(session, page, node_id=node_id)
    return {"items": items, "next_cursor": nxt}


@admin.put(
    "/gpus/{gpu_id}/mig-layout",
    status_code=202,
    response_model=MigRelayoutOut,
    summary="Lay a GPU out as these MIG instances (or a whole GPU), through its node's agent",
    description=(
        "Only on an idle GPU of a node whose agent can lay out MIG instances: the GPU takes no "
        "work until its agent reports the layout applied (then MIG work goes on those "
        "instances), refused or failed."
    ),
)
def set_mig_layout(gpu_id: str, body: MigLayoutIn, auth: Platform, session: DbSession):
    gpu = get_or_404(session, Gpu, gpu_id, what="gpu", for_update=True)
    return mig.request_on_gpu(session, gpu, body, "operator")


@admin.get("/gpus/{gpu_id}", response_model=GpuDetail, summary="Read a GPU and who holds it")
def read_gpu(gpu_id: str, auth: Platform, session: DbSession) -> dict:
    gpu = get_or_404(session, Gpu, gpu_id, what="gpu")
    return gpu_detail(gpu, holders(session, [gpu.node_id]).get((gpu.node_id, gpu.index), []))
