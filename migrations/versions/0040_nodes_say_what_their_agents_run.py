"""Nodes say what their agents can run (runtimes, a uid per run): placement puts work only where
its runtime is offered, and `process` work only in the pools the operator trusts with it

Revision ID: 0040
Revises: 0039
Create Date: 2026-11-28 02:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("agent_offers", sa.JSON(), nullable=True))
    # Nodes whose agents reported before: what they offered then (their next inventory says).
    agents = sa.table("agent_nodes", sa.column("node_id"), sa.column("runtimes"))
    nodes = sa.table("nodes", sa.column("id"), sa.column("agent_offers"))
    bind = op.get_bind()
    for node_id, runtimes in bind.execute(sa.select(agents.c.node_id, agents.c.runtimes)).all():
        bind.execute(
            nodes.update().where(nodes.c.id == node_id).values(agent_offers=runtimes or ["process"])
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("agent_offers")
