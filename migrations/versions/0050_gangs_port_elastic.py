"""A gang's rendezvous port, chosen when it is placed; elastic gangs' sizes (issue 46)

Revision ID: 0050
Revises: 0049
Create Date: 2026-11-29 16:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0050"
down_revision = "0049"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workloads", sa.Column("master_port", sa.Integer(), nullable=True))
    op.add_column("workloads", sa.Column("min_replicas", sa.Integer(), nullable=True))
    op.add_column("workloads", sa.Column("current_replicas", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("workloads", "current_replicas")
    op.drop_column("workloads", "min_replicas")
    op.drop_column("workloads", "master_port")
