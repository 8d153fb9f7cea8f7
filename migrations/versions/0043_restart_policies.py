"""Restart policies: what restarts a workload and how often (`restart_policy`), the restarts it
has had by cause (`restart_counts`), and when a backed-off one may be placed again
(`not_before`)

Revision ID: 0043
Revises: 0042
Create Date: 2026-11-29 06:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0043"
down_revision = "0042"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.add_column(sa.Column("restart_policy", sa.JSON(), nullable=True))
        batch.add_column(
            sa.Column("restart_counts", sa.JSON(), nullable=False, server_default="{}")
        )
        batch.add_column(sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.drop_column("not_before")
        batch.drop_column("restart_counts")
        batch.drop_column("restart_policy")
