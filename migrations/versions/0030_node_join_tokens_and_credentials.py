"""Node agents join with a single-use token and then speak with a node credential (hashes only)

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-26 11:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_join_tokens",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_node_join_tokens_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_join_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_node_join_tokens_token_hash")),
    )
    op.create_index(
        op.f("ix_node_join_tokens_node_id"), "node_join_tokens", ["node_id"], unique=False
    )
    op.create_table(
        "node_credentials",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("prefix", sa.String(length=8), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_node_credentials_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_credentials")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_node_credentials_secret_hash")),
    )
    op.create_index(
        op.f("ix_node_credentials_node_id"), "node_credentials", ["node_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_node_credentials_node_id"), table_name="node_credentials")
    op.drop_table("node_credentials")
    op.drop_index(op.f("ix_node_join_tokens_node_id"), table_name="node_join_tokens")
    op.drop_table("node_join_tokens")
