"""Nodes' GPUs, as rows (the fleet view reads hundreds)."""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models.fleet import Gpu


def load(session: Session, node_ids: list[uuid.UUID]) -> list[list[Any]]:
    by: dict[uuid.UUID, list[Any]] = defaultdict(list)
    for g in session.execute(  # rows, not objects: the fleet view reads hundreds
        select(
            Gpu.id,
            Gpu.node_id,
            Gpu.index,
            Gpu.model,
            Gpu.health,
            Gpu.health_reason,
            Gpu.perf,
            Gpu.mig_mode,
            Gpu.mig_layout,
            Gpu.relayout_pending,
        )
        .where(Gpu.node_id.in_(node_ids))
        .order_by(Gpu.node_id, Gpu.index)
    ):
        by[g.node_id].append(g)
    return [by.get(i, []) for i in node_ids]
