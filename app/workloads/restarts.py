"""Restarts: whether a workload whose run ended early goes back to the queue or fails, by its
restart policy (app/workloads/schemas.py `RestartPolicy`): the cause must be one it restarts
after, and the restarts its policy counts must not be spent; a counted restart after the first
backs off (its `not_before`), doubling each time. Every path that requeues a workload whose run
ended (a fault, a node gone, a preemption, its own failure, a start that failed) comes here,
so no cause loops without bound."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.audit import service as audit
from app.core.db import utcnow
from app.models.workloads import Workload
from app.outbox.service import enqueue
from app.scheduling import lifecycle
from app.scheduling.lifecycle import State
from app.workloads.queueing import requeue_reason
from app.workloads.schemas import RestartPolicy

Cause = Literal["failure", "infrastructure", "preemption"]
_WORDS = {
    "failure": "its own failure",
    "infrastructure": "an infrastructure fault",
    "preemption": "a preemption",
}


def policy_of(w: Workload) -> RestartPolicy:
    stored = dict(w.restart_policy or {})
    try:
        return RestartPolicy.model_validate(stored)
    except ValidationError:
        # Stored before uncounted restarts were refused: its loose causes count now.
        on = stored.get("on") or []
        counts = list(stored.get("counts") or [])
        stored["counts"] = counts + [c for c in on if c != "preemption" and c not in counts]
        return RestartPolicy.model_validate(stored)


@dataclass(frozen=True)
class Verdict:
    restart: bool
    delay_s: float
    # What the event says: "restart 3 of 10 (infrastructure), in 20 s", or why it fails.
    words: str
    details: dict[str, Any]


def counted(w: Workload, policy: RestartPolicy) -> int:
    counts = w.restart_counts or {}
    return sum(int(counts.get(c, 0)) for c in policy.counts)


def decide(w: Workload, cause: Cause) -> Verdict:
    """Whether `w` restarts after `cause`, and after how long (pure: reads the row only)."""
    policy = policy_of(w)
    done = counted(w, policy)
    base = {"cause": cause, "restarts": dict(w.restart_counts or {})}
    if cause not in policy.on:
        return Verdict(
            False,
            0.0,
            f"its restart policy does not restart it after {_WORDS[cause]}",
            {**base, "restart": False, "why": "cause_not_restarted"},
        )
    if cause not in policy.counts:
        return Verdict(True, 0.0, f"restarts ({cause}s do not count)", {**base, "restart": True})
    if done >= policy.max_restarts:
        spent = ", ".join(f"{c} {n}" for c, n in sorted(base["restarts"].items()) if n) or "none"
        return Verdict(
            False,
            0.0,
            f"restart limit reached: {done} of {policy.max_restarts} restarts spent ({spent})",
            {**base, "restart": False, "why": "restart_limit_reached"},
        )
    n = done + 1
    delay = 0.0 if n == 1 else float(min(policy.backoff_max_s, policy.backoff_s * 2 ** (n - 2)))
    when = f", in {delay:g} s" if delay else ""
    return Verdict(
        True,
        delay,
        f"restart {n} of {policy.max_restarts} ({cause}){when}",
        {**base, "restart": True, "restart_number": n, "backoff_s": delay},
    )


def requeue(
    session: Session,
    w: Workload,
    cause: Cause,
    what: str,
    details: dict[str, Any] | None = None,
    *,
    at: datetime | None = None,
    audit_reason: str,
    operator_details: dict[str, Any] | None = None,
    resumes: bool = True,
    said: bool = False,
    then: str = "",
) -> bool:
    """`w`'s run ended early (the caller released its allocations), `what` says how: back to
    the queue, if its policy restarts it after `cause` (backing off as it says; the event says
    what it resumes from, unless `resumes` is False: it never started), else failed, saying
    why. `said`: the event before (its `preempted`) already said `what`, so the requeue's does
    not repeat it. `then` follows the requeue's words ("ahead of its priority peers").
    Either way one audit entry, `workload.requeue` or `workload.fail`, with `audit_reason`.
    Whether it was requeued."""
    verdict = decide(w, cause)
    now = at or utcnow()
    info = {**(details or {}), "restart": verdict.details}
    audit.record_system(
        session,
        "workload.requeue" if verdict.restart else "workload.fail",
        [
            (
                w.tenant_id,
                "workload",
                w.id,
                {"reason": audit_reason, "cause": cause}
                | ({} if verdict.restart else {"why": verdict.details["why"]}),
                operator_details or {},
            )
        ],
    )
    if not verdict.restart:
        w.expedited = False
        lifecycle.transition(
            session, w, State.failed, f"{what}; not restarted: {verdict.words}", info, at=now
        )
        return False
    if resumes:
        words, more = requeue_reason(w)
        info = {**more, **info}
    else:
        words = "back in the queue"
    counts = dict(w.restart_counts or {})
    counts[cause] = int(counts.get(cause, 0)) + 1
    w.restart_counts = counts
    w.not_before = utcnow() + timedelta(seconds=verdict.delay_s) if verdict.delay_s else None
    reason = f"{words}{then}; {verdict.words}"
    if not said:
        reason = f"{what}; {reason}"
    lifecycle.transition(session, w, State.queued, reason, info, at=now)
    if verdict.delay_s and w.region:
        # Its back-off ends: a cycle then (the placement tick would also find it).
        enqueue(
            session,
            "placement.cycle",
            queue="placement",
            countdown=verdict.delay_s + 0.05,
            region=w.region,
        )
    return True
