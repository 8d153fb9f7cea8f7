"""What a failover looks like to a client is a 503 with Retry-After, never a 500: a write that
reaches a node that just became a replica (SQLSTATE 25006, which SQLAlchemy wraps as an
InternalError), the old leader shutting down (57P01), a reset connection, no master named by
the Sentinels yet. A real bug stays a 500."""

from __future__ import annotations

import psycopg
from sqlalchemy.exc import InternalError, OperationalError

from app.core.errors import _is_unavailable


def test_failover_errors_are_unavailable_and_bugs_are_not():
    ro = psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
    assert _is_unavailable(InternalError("INSERT INTO workloads ...", {}, ro))
    down = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert _is_unavailable(OperationalError("SELECT 1", {}, down))
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as exc:
            raise RuntimeError("the broker went away") from exc
    except RuntimeError as wrapped:
        assert _is_unavailable(wrapped)
    assert not _is_unavailable(KeyError("a bug"))
    bad = psycopg.errors.UndefinedColumn('column "nope" does not exist')
    assert not _is_unavailable(InternalError("SELECT nope", {}, bad))
