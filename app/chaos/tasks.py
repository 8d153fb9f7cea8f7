"""Chaos tasks: the abort conditions of running experiments, checked on a timer."""

from __future__ import annotations

from celery import shared_task

from app.chaos.watch import check_aborts, fire_due
from app.core.db import session_scope
from app.core.logging import get_logger

log = get_logger(__name__)


@shared_task(name="chaos.watch", ignore_result=True)
def watch() -> int:
    """Beat: abort running experiments whose abort condition holds (undoing what they did);
    run the rounds of scheduled experiments that are due."""
    with session_scope() as session:
        aborted = check_aborts(session)
    with session_scope() as session:
        fired = fire_due(session)
    if aborted:
        log.warning("chaos_aborted", experiments=[str(x) for x in aborted])
    if fired:
        log.info("chaos_round", experiments=[str(x) for x in fired])
    return len(aborted)
