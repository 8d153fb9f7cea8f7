"""Shared schema pieces: strict request models, pagination."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime
from typing import Any, Generic, TypeVar

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Select, tuple_
from sqlalchemy.orm import Session

from app.core.errors import AppError

T = TypeVar("T")


# Text the API takes: no NUL character (PostgreSQL cannot store one in text, and no name, label
# or reason needs it). Every free string of a request body says so in the OpenAPI document.
NO_NUL_PATTERN = "^[^\\u0000]*$"
# Billing months: YYYY-MM from 1970-01 to 2999-12 (a window the ledger's instants can hold).
PERIOD_PATTERN = r"^(19[7-9][0-9]|2[0-9]{3})-(0[1-9]|1[0-2])$"
# Cursors are this API's own: URL-safe base64 of a small JSON array.
CURSOR_PATTERN = r"^[A-Za-z0-9_-]{1,512}$"


def text_query(default: Any = None, *, max_length: int = 64, **kwargs: Any) -> Any:
    """A free-text query parameter: bounded, and (as in bodies) no NUL character."""
    return Query(default, max_length=max_length, pattern=NO_NUL_PATTERN, **kwargs)


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def _no_nul_in_schema(node: Any) -> None:
    """Add NO_NUL_PATTERN to every free string schema (no pattern, format, enum or const)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return
        if node.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(node):
            node["pattern"] = NO_NUL_PATTERN
        for key, value in node.items():
            if key not in ("examples", "default"):
                _no_nul_in_schema(value)
    elif isinstance(node, list):
        for value in node:
            _no_nul_in_schema(value)


def _strict_schema(schema: dict[str, Any], _model: type) -> None:
    _no_nul_in_schema(schema.get("properties", {}))


class StrictModel(BaseModel):
    """Request bodies: unknown fields are an error, not silently dropped, and no text holds a
    NUL character (a clear 422 naming the field, instead of the database's refusal)."""

    model_config = ConfigDict(
        extra="forbid", str_strip_whitespace=True, json_schema_extra=_strict_schema
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        if _has_nul(value):
            raise ValueError("text may not contain the NUL character (U+0000)")
        return value


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
            None,
            pattern=CURSOR_PATTERN,
            description="Opaque cursor from a previous page's `next_cursor`.",
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
