"""Join tokens that adopt: a node's first agent inventory may create its GPUs' record
(`node_join_tokens.adopt`, carried to `nodes.adopt_inventory` when the token is spent)

Revision ID: 0044
Revises: 0043
Create Date: 2026-11-29 07:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0044"
down_revision = "0043"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_join_tokens") as batch:
        batch.add_column(
            sa.Column("adopt", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(
            sa.Column("adopt_inventory", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("adopt_inventory")
    with op.batch_alter_table("node_join_tokens") as batch:
        batch.drop_column("adopt")
