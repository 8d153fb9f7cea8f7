"""Racks' names and their regions' names."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models.fleet import Rack, Region


def load(session: Session, rack_ids: list[uuid.UUID]) -> list[tuple[str, str]]:
    names = {
        rid: (rack, region)
        for rid, rack, region in session.execute(
            select(Rack.id, Rack.name, Region.name)
            .join(Region, Rack.region_id == Region.id)
            .where(Rack.id.in_(rack_ids))
        )
    }
    return [names.get(i, ("", "")) for i in rack_ids]
