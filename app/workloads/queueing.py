"""Back in the queue: what a requeued workload resumes from, and the placement cycle that work
waiting, or capacity freed, calls for."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.core.db import as_aware
from app.models.workloads import Workload
from app.outbox import kicks


def requeue_reason(w: Workload) -> tuple[str, dict]:
    """What a requeued workload resumes from, said truly: its checkpoint, or the start."""
    at = w.last_checkpoint_at
    if at is None:
        return "requeued: restarts from the beginning (no checkpoint was reported)", {
            "last_checkpoint_at": None,
            "resumes_from": "start",
        }
    where = f" ({w.last_checkpoint_uri})" if w.last_checkpoint_uri else ""
    return (
        f"requeued: resumes from its checkpoint of {as_aware(at):%Y-%m-%d %H:%M:%S} UTC{where}",
        {
            "last_checkpoint_at": at.isoformat(),
            "resumes_from": "checkpoint",
            "checkpoint_uri": w.last_checkpoint_uri,
            "checkpoint_step": w.last_checkpoint_step,
        },
    )


def kick_placement(session: Session, region: str | None) -> None:
    """A placement cycle for `region` soon after the commit: work waits there or capacity
    freed up. Coalesced and not durable (the placement tick is the guarantee)."""
    if region:
        kicks.kick(session, "placement.cycle", queue="placement", key=region, region=region)
