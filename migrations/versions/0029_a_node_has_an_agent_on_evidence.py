"""A node has an agent on evidence of one (a stream of reports), not on any single push

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-27 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "node_heartbeats", sa.Column("stream_since", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "node_heartbeats",
        sa.Column("stream_beats", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    # Nodes that reported before this: their agent shows itself again by its stream (a node
    # that stopped long ago is no longer expected to report).
    op.add_column(
        "node_heartbeats",
        sa.Column("agent", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("node_heartbeats", "agent")
    op.drop_column("node_heartbeats", "stream_beats")
    op.drop_column("node_heartbeats", "stream_since")
