"""agent_nodes.last_report_at: never read (a node's last word is its heartbeat row)

Revision ID: 0052
Revises: 0051
Create Date: 2026-11-29 21:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0052"
down_revision = "0051"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agent_nodes") as batch:
        batch.drop_column("last_report_at")


def downgrade() -> None:
    op.add_column(
        "agent_nodes", sa.Column("last_report_at", sa.DateTime(timezone=True), nullable=True)
    )
