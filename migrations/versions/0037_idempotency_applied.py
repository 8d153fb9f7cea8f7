"""Idempotency records say, in the request's own transaction, that it was applied: a request
whose commit landed but whose answer was lost (a failover during COMMIT) is never run again

Revision ID: 0037
Revises: 0036
Create Date: 2026-11-27 04:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("idempotency_records", sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("idempotency_records") as batch:
        batch.drop_column("applied_at")
