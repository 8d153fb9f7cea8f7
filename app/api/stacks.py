"""Node software stacks (`/v1/admin/stacks`): declared by operators, assigned to nodes."""

from __future__ import annotations

from fastapi import Path

from app.core.routing import DbSession, api_router
from app.stacks import service
from app.stacks.schemas import NAME, StackAssign, StackAssigned, StackCreate, StackList, StackOut
from app.tenancy.auth import Platform

admin = api_router(prefix="/v1/admin", tags=["admin: fleet"])

StackName = Path(min_length=1, max_length=63, pattern=NAME, description="The stack's name")


@admin.post(
    "/stacks",
    status_code=201,
    response_model=StackOut,
    summary="Declare a software stack (driver, CUDA, NCCL, firmware, fabric manager, OS image)",
    description="Stacks never change: a new version is a new stack, under a new name.",
)
def create_stack(body: StackCreate, auth: Platform, session: DbSession) -> StackOut:
    return service.create(session, body)


@admin.get("/stacks", response_model=StackList, summary="The software stacks, by name")
def list_stacks(auth: Platform, session: DbSession) -> StackList:
    return StackList(items=service.list_all(session))


@admin.get("/stacks/{name}", response_model=StackOut, summary="A software stack and its nodes")
def read_stack(auth: Platform, session: DbSession, name: str = StackName) -> StackOut:
    return service.describe(session, service.get(session, name))


@admin.post(
    "/stacks/{name}/assignments",
    response_model=StackAssigned,
    summary="Declare that a pool's, a region's or named nodes should run this stack",
    description=(
        "At once, for every node of the target: a node whose agent reports other versions "
        "is then drifted (each differing component named on the node) and takes no gang "
        "until it matches. `rackplane fleet upgrade` moves busy nodes a batch at a time."
    ),
)
def assign_stack(
    body: StackAssign, auth: Platform, session: DbSession, name: str = StackName
) -> StackAssigned:
    return service.assign(session, service.get(session, name), body)
