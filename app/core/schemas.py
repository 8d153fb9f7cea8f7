"""Shared schema pieces: strict request models, pagination."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime
from typing import Any, Generic, TypeVar

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Select, tuple_
from sqlalchemy.orm import Session

from app.core.errors import AppError

T = TypeVar("T")


class StrictModel(BaseModel):
    """Request bodies: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class OutModel(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(
        None, description="Pass as `cursor` to get the next page; null at the end."
    )


class PageParams:
    def __init__(
        self,
        limit: int = Query(50, ge=1, le=500, description="Page size."),
        cursor: str | None = Query(
            None, description="Opaque cursor from a previous page's `next_cursor`."
        ),
    ):
        self.limit = limit
        self.cursor = cursor


class InvalidCursor(AppError):
    status, code, title = 400, "invalid_cursor", "Invalid cursor"


def _encode(created_at: datetime, obj_id: Any) -> str:
    raw = json.dumps([created_at.isoformat(), str(obj_id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ts, oid = json.loads(raw)
        return datetime.fromisoformat(ts), uuid.UUID(oid)
    except Exception:
        raise InvalidCursor("The cursor is not one this API issued.") from None


def paginate(
    session: Session, stmt: Select, model: Any, page: PageParams
) -> tuple[list[Any], str | None]:
    """Keyset pagination over (created_at, id): stable under inserts, O(limit) per page."""
    if page.cursor:
        ts, oid = _decode(page.cursor)
        stmt = stmt.where(tuple_(model.created_at, model.id) > tuple_(ts, oid))
    rows = list(session.scalars(stmt.order_by(model.created_at, model.id).limit(page.limit + 1)))
    nxt = None
    if len(rows) > page.limit:
        rows = rows[: page.limit]
        nxt = _encode(rows[-1].created_at, rows[-1].id)
    return rows, nxt
