"""Software stacks: pinned driver/CUDA/NCCL/firmware/fabric manager/OS versions, the stack each
node should run, its pool, its drift from that stack and its CUDA version; what software a
workload needs

Revision ID: 0033
Revises: 0032
Create Date: 2026-11-26 16:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "software_stacks",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("description", sa.String(length=500), nullable=True),
        sa.Column("components", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_software_stacks")),
        sa.UniqueConstraint("name", name=op.f("uq_software_stacks_name")),
    )
    op.create_index(
        op.f("ix_software_stacks_created_at"), "software_stacks", ["created_at"], unique=False
    )
    op.add_column("nodes", sa.Column("pool", sa.String(length=63), nullable=True))
    op.add_column("nodes", sa.Column("stack_id", sa.Uuid(), nullable=True))
    op.add_column("nodes", sa.Column("drift", sa.JSON(), server_default="[]", nullable=False))
    op.add_column(
        "nodes", sa.Column("cuda_version", sa.Integer(), server_default="0", nullable=False)
    )
    if op.get_bind().dialect.name != "sqlite":  # SQLite adds no constraint to a table
        op.create_foreign_key(
            op.f("fk_nodes_stack_id_software_stacks"),
            "nodes",
            "software_stacks",
            ["stack_id"],
            ["id"],
            ondelete="RESTRICT",
        )
    op.create_index(op.f("ix_nodes_pool"), "nodes", ["pool"], unique=False)
    op.create_index(op.f("ix_nodes_stack_id"), "nodes", ["stack_id"], unique=False)
    op.add_column("workloads", sa.Column("stack", sa.String(length=63), nullable=True))
    op.add_column(
        "workloads", sa.Column("min_cuda", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("workloads", "min_cuda")
    op.drop_column("workloads", "stack")
    op.drop_index(op.f("ix_nodes_stack_id"), table_name="nodes")
    op.drop_index(op.f("ix_nodes_pool"), table_name="nodes")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f("fk_nodes_stack_id_software_stacks"), "nodes", type_="foreignkey")
    for column in ("cuda_version", "drift", "stack_id", "pool"):
        op.drop_column("nodes", column)
    op.drop_index(op.f("ix_software_stacks_created_at"), table_name="software_stacks")
    op.drop_table("software_stacks")
