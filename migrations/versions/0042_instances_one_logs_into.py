"""Instances one logs into: the SSH keys a workload was launched with, and where its SSH server
answers (the node's address and port its agent picked, and when it first answered)

Revision ID: 0042
Revises: 0041
Create Date: 2026-11-28 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0042"
down_revision = "0041"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.add_column(sa.Column("ssh_keys", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("ssh_host", sa.String(length=253), nullable=True))
        batch.add_column(sa.Column("ssh_port", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("ssh_ready_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workloads") as batch:
        batch.drop_column("ssh_ready_at")
        batch.drop_column("ssh_port")
        batch.drop_column("ssh_host")
        batch.drop_column("ssh_keys")
