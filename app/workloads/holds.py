"""Work held back before placement: dependencies (`depends_on`, as Slurm's
`--dependency=afterok`) and job arrays' `max_parallel` (Slurm's `--array=...%M`).

A held workload is queued with `hold` set (`Dependency`, `ArrayLimit`): placement cycles do not
see it (app/scheduling/world.py), and its pending reason is written here. When a workload
ends, its transaction sends the `workloads.holds` sweep if it had dependents or was an array's
element (app/scheduling/lifecycle.py); the beat sends it every few seconds too, which covers a
dependency that ended while its dependent was being submitted. The sweep releases work whose
dependencies all succeeded (up to its array's limit), fails work one of whose dependencies
failed or was terminated (that can never be met), and keeps each reason's words current."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, or_, select, text
from sqlalchemy.orm import Session, aliased

from app.audit import service as audit
from app.core.db import utcnow
from app.core.errors import ValidationFailed
from app.models.workloads import PendingReason, State, Workload, WorkloadDependency
from app.scheduling import lifecycle, pending
from app.scheduling.lifecycle import TERMINAL
from app.tenancy.scoping import restrict
from app.workloads.queueing import kick_placement

DEPENDENCY = "Dependency"
ARRAY_LIMIT = "ArrayLimit"
BROKEN = frozenset({State.failed.value, State.terminated.value})
_ENDED = [s.value for s in TERMINAL]
# One sweep at a time (PostgreSQL): two would count an array's elements under way each on its
# own and release past its limit.
_SWEEP_LOCK = 0x52504844  # "RPHD"
NAMED = 3  # workloads named in a reason's words, at most
CHUNK = 1000  # ids per IN list


def dependencies(session: Session, tenant_id: uuid.UUID, ids: list[uuid.UUID]) -> list[uuid.UUID]:
    """For a submission: the workloads `ids` name (an array's id: each of its elements) that
    have not succeeded yet, which it waits for. 422 `unknown_dependency` for an id that is no
    workload or array of the tenant's (another tenant's included), 422 `dependency_failed` for
    one that failed or was terminated: it could never start."""
    if not ids:
        return []
    rows = session.execute(
        restrict(
            tenant_id,
            select(Workload.id, Workload.array_id, Workload.state, Workload.name),
            Workload,
        ).where(or_(Workload.id.in_(ids), Workload.array_id.in_(ids)))
    ).all()
    known = {r.id for r in rows} | {r.array_id for r in rows if r.array_id is not None}
    missing = [str(i) for i in ids if i not in known]
    if missing:
        raise ValidationFailed(
            f"You have no workload or job array {', '.join(missing)} to depend on.",
            code="unknown_dependency",
            field="depends_on",
        )
    broken = [r for r in rows if r.state in BROKEN]
    if broken:
        raise ValidationFailed(
            f"It would never start: {_names(broken)} it depends on "
            f"{'has' if len(broken) == 1 else 'have'} already ended "
            f"{' or '.join(sorted({r.state for r in broken}))}.",
            code="dependency_failed",
            field="depends_on",
        )
    return sorted({r.id for r in rows if r.state != State.succeeded.value})


def _names(rows: Iterable) -> str:
    rows = list(rows)
    named = [f"{r.name} ({str(r.id)[:8]})" if r.name else str(r.id)[:8] for r in rows[:NAMED]]
    more = f" and {len(rows) - NAMED} more" if len(rows) > NAMED else ""
    return ", ".join(named) + more


def waits_for(left: list, of: int) -> str:
    """A `Dependency` reason's words."""
    return f"waits for {len(left)} of the {of} workloads it depends on to succeed: {_names(left)}"


def array_full(under_way: int, limit: int) -> str:
    """An `ArrayLimit` reason's words."""
    return f"{under_way} of its array's elements are under way (max_parallel {limit})"


def release(session: Session) -> int:
    """The sweep, in the caller's transaction: release, fail or re-word held work; returns how
    many were released or failed. Every held workload is looked at (as plain rows: only those
    that change are loaded and locked), so an array's elements go in index order however many
    wait."""
    if (
        session.scalar(
            select(Workload.id)
            .where(Workload.hold.is_not(None), Workload.state == State.queued.value)
            .limit(1)
        )
        is None
    ):
        return 0
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SWEEP_LOCK})
    now = utcnow()
    held = session.execute(
        select(
            Workload.id,
            Workload.tenant_id,
            Workload.hold,
            Workload.array_id,
            Workload.array_index,
            Workload.array_count,
            Workload.array_max_parallel,
        )
        .where(Workload.hold.is_not(None), Workload.state == State.queued.value)
        .order_by(Workload.array_id, Workload.array_index, Workload.id)
    ).all()
    sweep = _judge(held, _needs(session, held))
    _array_places(session, sweep)
    done, regions = _apply(session, sweep, now)
    session.flush()
    if done:
        session.execute(delete(PendingReason).where(PendingReason.workload_id.in_(done)))
    pending.write(session, [r for r in sweep.reasons if r[0] not in set(done)], now)
    for region in regions:
        kick_placement(session, region)
    return len(done)


@dataclass
class _Sweep:
    """What the sweep decided: who is freed, who fails (and on which dependency), who goes on
    waiting for a place in its array, and each one's pending reason."""

    reasons: list[tuple[uuid.UUID, uuid.UUID, str, str]] = field(default_factory=list)
    failing: dict[uuid.UUID, Any] = field(default_factory=dict)
    freed: list[uuid.UUID] = field(default_factory=list)
    candidates: dict[uuid.UUID, list] = field(default_factory=dict)  # by array, index order
    to_limit: list[uuid.UUID] = field(default_factory=list)


def _needs(session: Session, held: list) -> dict[uuid.UUID, list]:
    """What each workload held for its dependencies waits for, with their states."""
    needs: dict[uuid.UUID, list] = {}
    waiting = [h.id for h in held if h.hold == DEPENDENCY]
    n = aliased(Workload)
    for i in range(0, len(waiting), CHUNK):
        for row in session.execute(
            select(WorkloadDependency.workload_id, n.id, n.name, n.state)
            .join(n, n.id == WorkloadDependency.needs_id)
            .where(WorkloadDependency.workload_id.in_(waiting[i : i + CHUNK]))
        ):
            needs.setdefault(row.workload_id, []).append(row)
    return needs


def _judge(held: list, needs: dict[uuid.UUID, list]) -> _Sweep:
    """Held work judged on its dependencies: failing, still waiting, or a candidate."""
    sweep = _Sweep()
    for h in held:
        if h.hold == DEPENDENCY:
            mine = needs.get(h.id, [])
            broken = [r for r in mine if r.state in BROKEN]
            if broken:
                sweep.failing[h.id] = broken[0]
                continue
            left = [r for r in mine if r.state != State.succeeded.value]
            if left:
                sweep.reasons.append((h.id, h.tenant_id, DEPENDENCY, waits_for(left, len(mine))))
                continue
        if h.array_id is not None:
            sweep.candidates.setdefault(h.array_id, []).append(h)
        else:
            sweep.freed.append(h.id)
    return sweep


def _array_places(session: Session, sweep: _Sweep) -> None:
    """The candidates of each array that take a free place; the rest wait (`ArrayLimit`)."""
    under_way = dict(
        session.execute(
            select(Workload.array_id, func.count())
            .where(
                Workload.array_id.in_(list(sweep.candidates)),
                Workload.state.not_in(_ENDED),
                Workload.hold.is_(None),
            )
            .group_by(Workload.array_id)
        ).all()
    ) if sweep.candidates else {}  # fmt: skip
    for array_id, hs in sweep.candidates.items():
        limit = hs[0].array_max_parallel or hs[0].array_count or len(hs)
        busy = under_way.get(array_id, 0)
        free = max(0, limit - busy)
        sweep.freed += [h.id for h in hs[:free]]
        for h in hs[free:]:
            if h.hold != ARRAY_LIMIT:
                sweep.to_limit.append(h.id)
            sweep.reasons.append((h.id, h.tenant_id, ARRAY_LIMIT, array_full(busy + free, limit)))


def _apply(session: Session, sweep: _Sweep, now: datetime) -> tuple[list, set]:
    """The decisions on the rows that change (locked, in id order); those released or failed,
    and the regions to kick."""
    failing, to_limit = sweep.failing, sweep.to_limit
    changed = sorted(set(sweep.freed) | set(failing) | set(to_limit))
    done: list[uuid.UUID] = []
    regions: set[str | None] = set()
    for i in range(0, len(changed), CHUNK):
        for w in session.scalars(
            select(Workload)
            .where(
                Workload.id.in_(changed[i : i + CHUNK]),
                Workload.hold.is_not(None),
                Workload.state == State.queued.value,
            )
            .order_by(Workload.id)
            .with_for_update()
        ):
            if w.id in failing:
                _fail(session, w, failing[w.id], now)
                done.append(w.id)
            elif w.id in to_limit:
                w.hold = ARRAY_LIMIT
            else:
                w.hold = None
                done.append(w.id)
                regions.add(w.region)
    return done, regions


def _fail(session: Session, w: Workload, broken, now: datetime) -> None:
    """Its dependency can never be met: it fails now, saying which."""
    audit.record_system(
        session,
        "workload.fail",
        [
            (
                w.tenant_id,
                "workload",
                w.id,
                {"reason": "dependency_failed", "dependency": str(broken.id)},
                {},
            )
        ],
    )
    lifecycle.transition(
        session,
        w,
        State.failed,
        f"{_names([broken])} it depends on ended {broken.state}: it can never start",
        {"cause": "dependency_failed", "dependency": str(broken.id), "state": broken.state},
        at=now,
    )
