"""Workload logs on the wire to tenants (what agents send is `rackplane_wire.LogBatch`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.core.schemas import OutModel


class LogChunkOut(OutModel):
    """A piece of one replica's output (stdout and stderr together), as its agent read it."""

    id: int = Field(description="Its place in the log: pass as `after` to read what follows")
    attempt: int = Field(description="The workload's run number this output is from")
    replica: int
    offset: int = Field(description="Where `data` starts in the run's output, in bytes")
    data: str = Field(description="UTF-8 text; undecodable bytes and NUL as U+FFFD")
    at: datetime = Field(description="When the agent read it (the node's clock)")


class LogPage(OutModel):
    items: list[LogChunkOut] = Field(description="In arrival order (by `id`)")
    next_after: int | None = Field(
        description="Pass as `after` to read on: the last item's id (the `after` sent when "
        "there is nothing newer yet). An empty page means nothing newer has arrived."
    )
