"""A node's reports can be cut off (chaos: node loss)

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-25 07:56:54.395603
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "node_heartbeats",
        sa.Column("partitioned", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("node_heartbeats", "partitioned")
