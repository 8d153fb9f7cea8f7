"""Chaos experiments run on a schedule: rounds so far, the next one, GPUs touched per region

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-25 08:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "chaos_experiments",
        sa.Column("rounds", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column(
        "chaos_experiments", sa.Column("next_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("chaos_experiments", sa.Column("touched", sa.JSON(), nullable=True))
    op.create_index(
        op.f("ix_chaos_experiments_next_at"), "chaos_experiments", ["next_at"], unique=False
    )
    # Experiments started before schedules ran their one round at once.
    op.execute("UPDATE chaos_experiments SET rounds = 1")


def downgrade() -> None:
    op.drop_index(op.f("ix_chaos_experiments_next_at"), table_name="chaos_experiments")
    op.drop_column("chaos_experiments", "touched")
    op.drop_column("chaos_experiments", "next_at")
    op.drop_column("chaos_experiments", "rounds")
