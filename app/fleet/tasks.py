from __future__ import annotations

import uuid

from celery import shared_task
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.core.db import RETRY_DB, session_scope, utcnow
from app.core.errors import AppError
from app.core.logging import get_logger
from app.fleet import upgrades
from app.fleet.service import apply_document
from app.models.fleet import FleetImport, ImportStatus

log = get_logger(__name__)


@shared_task(
    name="fleet.import",
    bind=True,
    ignore_result=True,
    max_retries=5,
    autoretry_for=RETRY_DB,
    retry_backoff=True,
    retry_backoff_max=60,
)
def import_fleet(self, import_id: str) -> str:
    """Apply a validated fleet import. Idempotent: a finished import is left alone."""
    iid = uuid.UUID(import_id)
    with session_scope() as session:
        stmt = select(FleetImport).where(FleetImport.id == iid)
        if session.get_bind().dialect.name == "postgresql":
            stmt = stmt.with_for_update()
        imp = session.scalar(stmt)
        if imp is None or imp.status in (ImportStatus.succeeded.value, ImportStatus.failed.value):
            return imp.status if imp else "missing"
        try:
            with session.begin_nested():
                imp.summary = apply_document(session, imp.document)
            imp.status = ImportStatus.succeeded.value
            imp.error = None
        except AppError as exc:
            imp.status, imp.error = ImportStatus.failed.value, exc.detail
        except IntegrityError as exc:
            # Another import created the same names concurrently: retry against the new state.
            raise self.retry(exc=exc, countdown=1) from exc
        imp.finished_at = utcnow()
        log.info("fleet_import_done", import_id=import_id, status=imp.status, summary=imp.summary)
        return imp.status


@shared_task(name="fleet.upgrades", ignore_result=True)
def upgrades_tick(upgrade_id: str | None = None) -> str:
    """Beat, and whenever something may move an upgrade on (it started, a burn-in of one
    ended, an operator resumed or rolled it back): one look at each active upgrade."""
    with session_scope() as session:
        if upgrade_id is not None:
            return upgrades.advance(session, uuid.UUID(upgrade_id), utcnow())
        return f"{upgrades.advance_all(session, utcnow())} active"
