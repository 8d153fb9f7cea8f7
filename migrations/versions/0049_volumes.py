"""Tenants' volumes (named directories their runs mount), and the ones a workload mounts

Revision ID: 0049
Revises: 0048
Create Date: 2026-11-29 14:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0049"
down_revision = "0048"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "volumes",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column(
            "tenant_id", sa.Uuid(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("storage", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_index("ix_volumes_created_at", "volumes", ["created_at"])
    op.add_column("workloads", sa.Column("volumes", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("workloads", "volumes")
    op.drop_index("ix_volumes_created_at", table_name="volumes")
    op.drop_table("volumes")
