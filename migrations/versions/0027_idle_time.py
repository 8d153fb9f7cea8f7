"""Idle GPU-seconds by hour, region, model and cause (the portal's idle-by-cause chart)

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-25 14:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idle_time",
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("region", sa.String(length=63), nullable=False),
        sa.Column("gpu_model", sa.String(length=32), nullable=False),
        sa.Column("cause", sa.String(length=16), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("bucket", "region", "gpu_model", "cause"),
    )
    op.create_index("ix_idle_time_updated_at", "idle_time", ["updated_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_idle_time_updated_at", table_name="idle_time")
    op.drop_table("idle_time")
