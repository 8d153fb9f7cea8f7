"""Arguments shared by several domains' fields, checked as REST checks its query parameters
and bodies (a `validation_error` naming what is wrong)."""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import Enum
from typing import Any

import strawberry
from pydantic import ValidationError

from app.core.errors import ValidationFailed
from app.graphql.views import field_errors, parse


@strawberry.enum(description="Usage time buckets")
class Granularity(Enum):
    HOUR = "hour"
    DAY = "day"


def aware(name: str, value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValidationFailed(f"{name} needs a UTC offset (RFC 3339).", code="validation_error")
    return value


def node_id(text: str) -> uuid.UUID | None:
    """An object's id (a UUID), or None when the text is none (so: not found)."""
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def parse_or_fail(model: Any, value: Any) -> Any:
    """For a query (no result union): invalid input is a ValidationFailed with field paths."""
    try:
        return parse(model, value)
    except ValidationError as e:
        fields = field_errors(e)
        raise ValidationFailed(
            "; ".join(f"{'.'.join(f['path'])}: {f['message']}" for f in fields),
            code="validation_error",
            fields=fields,
        ) from None
