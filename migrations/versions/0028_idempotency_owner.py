"""Idempotency records remember the key that made them: a replay goes to that key only

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-26 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for anonymous (signup) records, and for records made before this column: those are
    # never replayed to anyone (they expire with the idempotency TTL).
    op.add_column("idempotency_records", sa.Column("owner", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("idempotency_records", "owner")
