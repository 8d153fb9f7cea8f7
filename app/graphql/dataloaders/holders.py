"""Who holds each GPU of some nodes (the fleet service's read, grouped per node)."""

from __future__ import annotations

import uuid
from collections import defaultdict

from sqlalchemy.orm import Session

from app.fleet.service import holders


def load(session: Session, node_ids: list[uuid.UUID]) -> list[dict[int, list[dict]]]:
    held = holders(session, node_ids)
    by: dict[uuid.UUID, dict[int, list[dict]]] = defaultdict(dict)
    for (node_id, index), hs in held.items():
        by[node_id][index] = hs
    return [by.get(i, {}) for i in node_ids]
