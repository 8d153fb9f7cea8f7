"""Rolling upgrades: an upgrade of a region's or pool's nodes to a software stack, and where
each of its nodes is

Revision ID: 0035
Revises: 0034
Create Date: 2026-11-27 00:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "upgrades",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("stack_id", sa.Uuid(), nullable=False),
        sa.Column("scope_kind", sa.String(length=8), nullable=False),
        sa.Column("scope", sa.String(length=63), nullable=False),
        sa.Column("batch", sa.String(length=8), nullable=False),
        sa.Column("units_at_once", sa.Integer(), nullable=False),
        sa.Column("max_unavailable_pct", sa.Float(), nullable=False),
        sa.Column("max_failures", sa.Integer(), nullable=False),
        sa.Column("drain_wait_s", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("state_reason", sa.String(length=500), nullable=True),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("failures_before", sa.Integer(), nullable=False),
        sa.Column("requested_by", sa.String(length=120), nullable=True),
        sa.Column("commands", sa.JSON(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["stack_id"],
            ["software_stacks.id"],
            name=op.f("fk_upgrades_stack_id_software_stacks"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upgrades")),
    )
    op.create_index(op.f("ix_upgrades_created_at"), "upgrades", ["created_at"], unique=False)
    op.create_index(op.f("ix_upgrades_stack_id"), "upgrades", ["stack_id"], unique=False)
    op.create_index(op.f("ix_upgrades_state"), "upgrades", ["state"], unique=False)
    op.create_table(
        "upgrade_nodes",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("upgrade_id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("unit", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("from_stack_id", sa.Uuid(), nullable=True),
        sa.Column("prior_state", sa.String(length=16), nullable=False),
        sa.Column("phase", sa.String(length=12), nullable=False),
        sa.Column("detail", sa.String(length=500), nullable=True),
        sa.Column("burn_in_id", sa.Uuid(), nullable=True),
        sa.Column("drain_deadline", sa.DateTime(timezone=True), nullable=True),
        sa.Column("work_moved", sa.Integer(), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("back_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("out_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_upgrade_nodes_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["upgrade_id"],
            ["upgrades.id"],
            name=op.f("fk_upgrade_nodes_upgrade_id_upgrades"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upgrade_nodes")),
        sa.UniqueConstraint(
            "upgrade_id", "node_id", name=op.f("uq_upgrade_nodes_upgrade_id_node_id")
        ),
    )
    op.create_index(
        op.f("ix_upgrade_nodes_upgrade_id"), "upgrade_nodes", ["upgrade_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_upgrade_nodes_upgrade_id"), table_name="upgrade_nodes")
    op.drop_table("upgrade_nodes")
    op.drop_index(op.f("ix_upgrades_state"), table_name="upgrades")
    op.drop_index(op.f("ix_upgrades_stack_id"), table_name="upgrades")
    op.drop_index(op.f("ix_upgrades_created_at"), table_name="upgrades")
    op.drop_table("upgrades")
