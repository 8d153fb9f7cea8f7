"""Loaders for one GraphQL operation, one per file (as Phoenix keeps them), gathered in
`Loaders`: each batches its keys into one statement on the context's session, through the
caller's scope where rows are tenant-owned."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from strawberry.dataloader import DataLoader

from app.graphql.dataloaders import events, gpus, holders, racks

Batch = Callable[[Callable[..., Any]], Callable[[list[Any]], Awaitable[Any]]]


@dataclass(frozen=True)
class Loaders:
    events: DataLoader[uuid.UUID, list[Any]]
    # Operators' fleet views (the fields check the platform scope before loading).
    gpus: DataLoader[uuid.UUID, list[Any]]
    holders: DataLoader[uuid.UUID, dict[int, list[dict]]]
    racks: DataLoader[uuid.UUID, tuple[str, str]]

    @classmethod
    def build(cls, batch: Batch, session_of: Callable[[], Any], auth_of: Callable[[], Any]):
        """`batch(fn)` runs `fn(keys)` where the context allows database work."""
        return cls(
            events=DataLoader(batch(lambda ids: events.load(session_of(), auth_of(), ids))),
            gpus=DataLoader(batch(lambda ids: gpus.load(session_of(), ids))),
            holders=DataLoader(batch(lambda ids: holders.load(session_of(), ids))),
            racks=DataLoader(batch(lambda ids: racks.load(session_of(), ids))),
        )
