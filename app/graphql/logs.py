"""A workload's log followed live (`workloadLogs`), over the same service, tenancy and follower
as REST's event stream (app/logs/follow.py).

Without `after` it starts with the newest output (up to `TAIL_BYTES` of it) and goes on as
chunks arrive; with `after` (an earlier chunk's `id`) it resumes after that chunk, missing
nothing and repeating nothing. It goes on while the client listens, the workload's end
included (an agent may still send the last lines)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from datetime import datetime

import strawberry

from app.core.db import as_aware, get_sessionmaker
from app.core.errors import AppError, ValidationFailed
from app.graphql.context import Context, coded
from app.graphql.subscriptions import log_reader
from app.graphql.views import BigInt
from app.logs import follow as following
from app.logs import service
from app.logs.schemas import LogChunkOut
from app.logs.service import LogQuery
from app.tenancy.principal import AuthContext


@strawberry.type(description="A piece of one replica's output (stdout and stderr together)")
class WorkloadLogChunk:
    id: BigInt = strawberry.field(  # type: ignore[valid-type]
        description="Its place in the log: pass as `after` to resume after it"
    )
    workload_id: strawberry.ID
    attempt: int = strawberry.field(description="The workload's run this output is from")
    replica: int
    offset: BigInt = strawberry.field(  # type: ignore[valid-type]
        description="Where `data` starts in the run's output, in bytes"
    )
    data: str = strawberry.field(description="UTF-8 text, as the agent read it")
    at: datetime = strawberry.field(description="When the agent read it (the node's clock)")

    @classmethod
    def of(cls, c: LogChunkOut, workload_id: str) -> WorkloadLogChunk:
        return cls(
            id=BigInt(c.id),
            workload_id=strawberry.ID(workload_id),
            attempt=c.attempt,
            replica=c.replica,
            offset=BigInt(c.offset),
            data=c.data,
            at=as_aware(c.at),
        )


def _start(auth: AuthContext, workload_id: str, query: LogQuery, after: int | None):
    """The workload (404 for another tenant's) and the cursor to follow from."""
    with get_sessionmaker()() as s:
        wid = service.owned_workload(s, auth, workload_id)
        return wid, after if after is not None else service.tail_start(s, auth, wid, query)


@strawberry.type
class LogSubscription:
    @strawberry.subscription(
        description="A workload's output as it arrives: the newest first (or what follows the "
        "chunk `after`), then each chunk as its agent ships it; one replica's with `replica`"
    )
    def workload_logs(
        self,
        info: strawberry.Info[Context, None],
        workload_id: strawberry.ID,
        replica: int | None = None,
        after: BigInt | None = None,  # type: ignore[valid-type]
    ) -> AsyncGenerator[WorkloadLogChunk, None]:
        context = info.context
        try:  # refusals as REST's, raised here: the subscription never starts
            auth = context.auth
            log_reader(auth)
            if replica is not None and not 0 <= replica <= 4095:
                raise ValidationFailed("replica is 0 to 4095.", code="invalid_replica")
            if after is not None and not 0 <= after <= 2**63 - 1:
                raise ValidationFailed("after is a chunk's id.", code="invalid_cursor")
            query = LogQuery(replica=replica)
            # One lookup by primary key and one of the tail's sizes, here rather than in the
            # stream: a refusal is the protocol's `error`, not an item.
            wid, cursor = _start(auth, str(workload_id), query, after)
        except AppError as e:
            raise coded(e) from e

        async def still_allowed() -> None:
            await still_allowed(context, log_reader)

        async def chunks() -> AsyncGenerator[WorkloadLogChunk, None]:
            events = following.follow(
                auth, wid, query, cursor, until_ended=False, still_allowed=still_allowed
            )
            try:
                async with aclosing(events):  # its waiter goes when the subscription does
                    async for event in events:
                        if isinstance(event, list):
                            for c in event:
                                yield WorkloadLogChunk.of(c, str(wid))
            except AppError as e:  # the workload went away meanwhile
                raise coded(e) from e

        return chunks()


__all__ = ["LogSubscription", "WorkloadLogChunk"]
