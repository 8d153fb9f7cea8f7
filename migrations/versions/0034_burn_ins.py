"""Burn-in: a node's validation suite run by its agent before it takes work, and when each
node first passed one (its time to production)

Revision ID: 0034
Revises: 0033
Create Date: 2026-11-26 17:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "burn_ins",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("repair_id", sa.Uuid(), nullable=True),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=12), nullable=False),
        sa.Column("suite", sa.JSON(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("failed_step", sa.String(length=63), nullable=True),
        sa.Column("failed_gpu", sa.SmallInteger(), nullable=True),
        sa.Column("gpus", sa.SmallInteger(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_burn_ins_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_burn_ins")),
    )
    op.create_index(op.f("ix_burn_ins_node_id"), "burn_ins", ["node_id"], unique=False)
    op.add_column("nodes", sa.Column("production_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "production_at")
    op.drop_index(op.f("ix_burn_ins_node_id"), table_name="burn_ins")
    op.drop_table("burn_ins")
