"""Allocations name the attempt (the workload's placement) they were made for: a node's writes
about a run are accepted only from the node holding that attempt's allocation

Revision ID: 0038
Revises: 0037
Create Date: 2026-11-28 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "allocations", sa.Column("attempt", sa.Integer(), server_default="0", nullable=False)
    )
    # Existing rows: each placement wrote its allocations with one `created_at` and counted one
    # attempt, so a workload's newest set is its latest attempt, the set before it the one
    # before, and so on (0 for placements older than the count).
    op.execute(
        "UPDATE allocations SET attempt = COALESCE("
        "(SELECT w.attempts FROM workloads w WHERE w.id = allocations.workload_id), 0) + 1 - ("
        "SELECT count(DISTINCT a2.created_at) FROM allocations a2"
        " WHERE a2.workload_id = allocations.workload_id"
        " AND a2.created_at >= allocations.created_at)"
    )
    op.execute("UPDATE allocations SET attempt = 0 WHERE attempt < 0")


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("attempt")
