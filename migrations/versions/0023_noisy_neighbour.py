"""A workload remembers its best pace on a shared GPU and the noisy GPUs it must avoid

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-25 08:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workloads", sa.Column("avoid_gpus", sa.JSON(), nullable=True))
    op.add_column("workloads", sa.Column("step_time_best_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("workloads", "step_time_best_s")
    op.drop_column("workloads", "avoid_gpus")
