"""MIG layouts through the agent: a GPU's instances as its agent reports them, layouts asked of
a GPU (pending until the agent applies them), and no work on a GPU being laid out again

Revision ID: 0036
Revises: 0035
Create Date: 2026-11-27 01:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("gpus", sa.Column("mig_layout", sa.JSON(), nullable=True))
    op.add_column(
        "gpus",
        sa.Column("relayout_pending", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    # Batch: SQLite (the embedded default) adds a CHECK by copying the table.
    with op.batch_alter_table("gpu_usage") as batch:
        batch.add_column(
            sa.Column("relayout", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch.create_check_constraint(
            "idle_while_relaid", "NOT relayout OR (milli_used = 0 AND memory_used_mib = 0)"
        )
    op.create_table(
        "mig_relayouts",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("mig_mode", sa.Boolean(), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=12), nullable=False),
        sa.Column("detail", sa.String(length=500), nullable=True),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_mig_relayouts_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mig_relayouts")),
    )
    op.create_index(op.f("ix_mig_relayouts_node_id"), "mig_relayouts", ["node_id"], unique=False)
    op.create_index(
        "uq_mig_relayouts_pending",
        "mig_relayouts",
        ["node_id", "gpu_index"],
        unique=True,
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("uq_mig_relayouts_pending", table_name="mig_relayouts")
    op.drop_index(op.f("ix_mig_relayouts_node_id"), table_name="mig_relayouts")
    op.drop_table("mig_relayouts")
    with op.batch_alter_table("gpu_usage") as batch:
        batch.drop_constraint("idle_while_relaid", type_="check")
        batch.drop_column("relayout")
    op.drop_column("gpus", "relayout_pending")
    op.drop_column("gpus", "mig_layout")
