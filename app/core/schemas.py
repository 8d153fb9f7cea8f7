"""Shared schema pieces: strict request models, pagination."""

from __future__ import annotations

import base64
import json
import re
import uuid
from datetime import UTC, date, datetime
from types import UnionType
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin

from fastapi import Query
from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NaiveDatetime,
    ValidationInfo,
    field_validator,
)
from sqlalchemy import Select, tuple_
from sqlalchemy.orm import Session

from app.core.errors import AppError

T = TypeVar("T")


# Text the API takes: no NUL character (PostgreSQL cannot store one in text, and no name, label
# or reason needs it). Every free string of a request body says so in the OpenAPI document.
NO_NUL_PATTERN = "^[^\\u0000]*$"
# A tenant's named things that other requests refer to by name (SSH keys, secrets).
RESOURCE_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,63}$"
# Free text in bodies: no NUL, and no space, tab or line break at either end (see text_error).
TEXT_PATTERN = "^([^\\u0000 \\t\\n\\r]([^\\u0000]*[^\\u0000 \\t\\n\\r])?)?$"
# Billing months: YYYY-MM from 1970-01 to 2999-12 (a window the ledger's instants can hold).
PERIOD_PATTERN = r"^(19[7-9][0-9]|2[0-9]{3})-(0[1-9]|1[0-2])$"
# The largest integer every JSON client reads exactly (RFC 7493, I-JSON): no input goes past it.
MAX_JSON_INT = 2**53 - 1
# Cursors are this API's own: URL-safe base64 of a small JSON array.
CURSOR_PATTERN = r"^[A-Za-z0-9_-]{1,512}$"


def _rfc3339(value: Any) -> Any:
    # A query string is text: a bare number is not a date-time here (pydantic would read it
    # as seconds since the epoch, which the schema's `format: date-time` does not allow).
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+(\.\d*)?\s*", value):
        raise ValueError("expected an RFC 3339 date-time, e.g. 2026-11-01T00:00:00Z")
    return value


# A date-time in a query string: RFC 3339 text only.
QueryDatetime = Annotated[datetime, BeforeValidator(_rfc3339)]


def text_query(default: Any = None, *, max_length: int = 64, **kwargs: Any) -> Any:
    """A free-text query parameter: bounded, and (as in bodies) no NUL character."""
    return Query(default, max_length=max_length, pattern=NO_NUL_PATTERN, **kwargs)


def _no_nul_in_schema(node: Any) -> None:
    """Add TEXT_PATTERN to every free string schema (no pattern, format, enum or const)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return
        if node.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(node):
            node["pattern"] = TEXT_PATTERN
        for key, value in node.items():
            if key not in ("examples", "default"):
                _no_nul_in_schema(value)
    elif isinstance(node, list):
        for value in node:
            _no_nul_in_schema(value)


def strict_schema(schema: dict[str, Any], _model: type) -> None:
    _no_nul_in_schema(schema.get("properties", {}))


def _scalar(annotation: Any) -> type | None:
    """The JSON-typed scalar a field is (optionally None): bool, int, float, or a type JSON
    carries as a string (datetime, date, UUID); else None."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        return _scalar(args[0])
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return _scalar(args[0])
    if annotation in (bool, int, float):
        return annotation
    if annotation in (AwareDatetime, NaiveDatetime) or (
        isinstance(annotation, type) and issubclass(annotation, date | uuid.UUID)
    ):
        return str
    return None


_JSON_TYPES: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "a boolean (true or false)"),
    int: ((int, float), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
}


def _json_type_error(kind: type, value: Any) -> str | None:
    types, what = _JSON_TYPES[kind]
    if not isinstance(value, types) or (kind is not bool and isinstance(value, bool)):
        return f"must be {what}"
    if kind is int and isinstance(value, float) and not value.is_integer():
        return "must be an integer"  # 3.0 is one (JSON Schema), 3.5 is not
    return None


# Free text (a string the schema gives no pattern, format or enum of its own) neither starts nor
# ends with a space, tab or line break: the API stores what it is sent, so " Acme" is refused
# with the field named rather than stored or silently trimmed.
_EDGE = " \t\n\r"


def text_error(value: Any) -> str | None:
    if isinstance(value, str):
        if "\x00" in value:
            return "text may not contain the NUL character (U+0000)"
        if value and (value[0] in _EDGE or value[-1] in _EDGE):
            return "text may not start or end with a space, tab or line break"
        return None
    if isinstance(value, dict):
        return next((e for k, v in value.items() if (e := text_error(k) or text_error(v))), None)
    if isinstance(value, list | tuple):
        return next((e for v in value if (e := text_error(v))), None)
    return None


class StrictModel(BaseModel):
    """Request bodies: unknown fields are an error, not silently dropped; numbers and booleans
    are taken as JSON types, as the schema states them (no "5" for 5, no 0 for false); and no
    text holds a NUL character (a clear 422 naming the field, instead of the database's
    refusal)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=strict_schema)

    @field_validator("*", mode="before")
    @classmethod
    def _json_values(cls, value: Any, info: ValidationInfo) -> Any:
        error = text_error(value)
        if error is None and value is not None and info.field_name is not None:
            kind = _scalar(cls.model_fields[info.field_name].annotation)
            error = _json_type_error(kind, value) if kind is not None else None
        if error:
            raise ValueError(error)
        return value


class PerCurrencyMarker:
    """Marks a sum of money per currency: `{"usd": 3813784}` in minor units. REST keeps the map;
    GraphQL lists it as amounts, each with its currency, in its one money type."""


PerCurrency = Annotated[dict[str, int], PerCurrencyMarker()]


def cursor_of(row: Any) -> str:
    """The cursor after `row` in a keyset page over (created_at, id) (see `paginate`)."""
    return encode_cursor(row.created_at, row.id)


class OutModel(BaseModel):
    """Replies. Every instant is UTC with its offset (`...Z`), whatever the database returns
    (SQLite gives naive datetimes back)."""

    model_config = ConfigDict(from_attributes=True)

    @field_validator("*", mode="before")
    @classmethod
    def _utc(cls, value: Any) -> Any:
        if isinstance(value, datetime) and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


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


def encode_cursor(created_at: datetime, obj_id: Any) -> str:
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
        nxt = encode_cursor(rows[-1].created_at, rows[-1].id)
    return rows, nxt
