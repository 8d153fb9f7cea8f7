"""Dependencies and job arrays: what a workload waits for (`depends_on`, held back as
`hold`), and the array an element belongs to

Revision ID: 0048
Revises: 0047
Create Date: 2026-11-29 13:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0048"
down_revision = "0047"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workloads") as b:
        b.add_column(sa.Column("depends_on", sa.JSON(), nullable=True))
        b.add_column(sa.Column("hold", sa.String(length=16), nullable=True))
        b.add_column(sa.Column("array_id", sa.Uuid(), nullable=True))
        b.add_column(sa.Column("array_index", sa.Integer(), nullable=True))
        b.add_column(sa.Column("array_count", sa.Integer(), nullable=True))
        b.add_column(sa.Column("array_max_parallel", sa.Integer(), nullable=True))
    op.create_index("ix_workloads_array_id", "workloads", ["array_id"])
    op.create_index(
        "ix_workloads_held",
        "workloads",
        ["hold"],
        postgresql_where=sa.text("hold IS NOT NULL"),
        sqlite_where=sa.text("hold IS NOT NULL"),
    )
    op.create_table(
        "workload_dependencies",
        sa.Column(
            "workload_id",
            sa.Uuid(),
            sa.ForeignKey("workloads.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "needs_id",
            sa.Uuid(),
            sa.ForeignKey("workloads.id", ondelete="CASCADE"),
            primary_key=True,
        ),
    )
    op.create_index("ix_workload_dependencies_needs_id", "workload_dependencies", ["needs_id"])


def downgrade() -> None:
    op.drop_index("ix_workload_dependencies_needs_id", table_name="workload_dependencies")
    op.drop_table("workload_dependencies")
    op.drop_index("ix_workloads_held", table_name="workloads")
    op.drop_index("ix_workloads_array_id", table_name="workloads")
    with op.batch_alter_table("workloads") as b:
        for c in (
            "array_max_parallel",
            "array_count",
            "array_index",
            "array_id",
            "hold",
            "depends_on",
        ):
            b.drop_column(c)
