"""Rolling upgrades (`/v1/admin/upgrades`): a region's or pool's nodes moved to a software
stack a few at a time (app/fleet/upgrades.py)."""

from __future__ import annotations

from fastapi import Path

from app.core.routing import DbSession, api_router
from app.fleet import upgrades as service
from app.fleet.schemas import UpgradeCreate, UpgradeList, UpgradeOut
from app.tenancy.auth import Platform

admin = api_router(prefix="/v1/admin", tags=["admin: fleet"])

UpgradeId = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$", description="Its id")


@admin.post(
    "/upgrades",
    status_code=202,
    response_model=UpgradeOut,
    summary="Start a rolling upgrade of a region's or pool's nodes to a software stack",
    description=(
        "A few units (a node, or an NVLink domain's nodes) at a time: each is cordoned, its "
        "work moves (at its next checkpoint, else with the preemption grace), its agent "
        "installs the stack with the operator's commands (RACKPLANE_UPGRADE_COMMANDS) and "
        "burns it in, and it returns to service. Pauses at `max_failures` failed nodes."
    ),
)
def start_upgrade(body: UpgradeCreate, auth: Platform, session: DbSession) -> UpgradeOut:
    up = service.start(session, body, requested_by=f"key {auth.key_prefix}")
    return service.describe(session, up)


@admin.get("/upgrades", response_model=UpgradeList, summary="Upgrades, newest first")
def list_upgrades(auth: Platform, session: DbSession) -> UpgradeList:
    return service.list_all(session)


@admin.get(
    "/upgrades/{upgrade_id}",
    response_model=UpgradeOut,
    summary="An upgrade's progress and report, node by node",
)
def read_upgrade(auth: Platform, session: DbSession, upgrade_id: str = UpgradeId) -> UpgradeOut:
    return service.describe(session, service.get(session, upgrade_id))


@admin.post(
    "/upgrades/{upgrade_id}/resume",
    response_model=UpgradeOut,
    summary="Resume a paused upgrade (its failed nodes are tried again)",
)
def resume_upgrade(auth: Platform, session: DbSession, upgrade_id: str = UpgradeId) -> UpgradeOut:
    up = service.resume(session, service.get(session, upgrade_id, lock=True))
    return service.describe(session, up)


@admin.post(
    "/upgrades/{upgrade_id}/rollback",
    response_model=UpgradeOut,
    summary="Roll an upgrade back: every node it touched returns to the stack it ran before",
)
def rollback_upgrade(auth: Platform, session: DbSession, upgrade_id: str = UpgradeId) -> UpgradeOut:
    up = service.rollback(session, service.get(session, upgrade_id, lock=True))
    return service.describe(session, up)
