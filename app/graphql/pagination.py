"""Pages: every list is a Relay connection over a keyset page (`app.core.schemas.paginate`),
its cursors REST's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import strawberry

from app.core.errors import ValidationFailed
from app.core.schemas import PageParams, cursor_of, encode_cursor

MAX_PAGE = 500  # as REST's limit

T = TypeVar("T")


@strawberry.type
class PageInfo:
    has_next_page: bool
    end_cursor: str | None


@strawberry.type(description="An item of a page, with the cursor to resume after it")
class Edge(Generic[T]):
    cursor: str
    node: T


@strawberry.type(description="A page (Relay connection), oldest first: every list is one")
class Connection(Generic[T]):
    edges: list[Edge[T]]
    page_info: PageInfo


def connection(rows: list[Any], node_of: Callable[[Any], T], next_cursor: str | None) -> Any:
    """A keyset page of rows (`app.core.schemas.paginate`) as a connection of their views."""
    return Connection(
        edges=[Edge(cursor=cursor_of(r), node=node_of(r)) for r in rows],
        page_info=page_info(next_cursor),
    )


def page_info(next_cursor: str | None) -> PageInfo:
    return PageInfo(has_next_page=next_cursor is not None, end_cursor=next_cursor)


def page_params(first: int, after: str | None) -> PageParams:
    if not 1 <= first <= MAX_PAGE:
        raise ValidationFailed(f"first is 1 to {MAX_PAGE}.", code="validation_error")
    return PageParams(limit=first, cursor=after)


def edge_cursor(row: Any) -> str:
    """A row's cursor in a hand-made connection (workloads, nodes): its creation and id."""
    return encode_cursor(row.created_at, row.id)
