"""Why a queued workload waits: one row per workload, written by its region's placement cycle

Revision ID: 0045
Revises: 0044
Create Date: 2026-11-29 07:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0045"
down_revision = "0044"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workload_pending",
        sa.Column(
            "workload_id",
            sa.Uuid(),
            sa.ForeignKey("workloads.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "tenant_id", sa.Uuid(), sa.ForeignKey("tenants.id", ondelete="RESTRICT"), nullable=False
        ),
        sa.Column("reason", sa.String(length=24), nullable=False),
        sa.Column("detail", sa.String(length=300), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workload_pending_tenant_id", "workload_pending", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_workload_pending_tenant_id", table_name="workload_pending")
    op.drop_table("workload_pending")
