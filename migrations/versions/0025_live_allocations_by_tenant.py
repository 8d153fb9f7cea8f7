"""A tenant's live allocations by a partial index: its quotas' held GPUs are one aggregate

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-25 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_allocations_live_by_tenant",
        "allocations",
        ["tenant_id"],
        unique=False,
        postgresql_where=sa.text("released_at IS NULL"),
        sqlite_where=sa.text("released_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_allocations_live_by_tenant",
        table_name="allocations",
        postgresql_where=sa.text("released_at IS NULL"),
        sqlite_where=sa.text("released_at IS NULL"),
    )
