"""Workload logs: each replica's output in chunks at their byte offset, as node agents ship it,
and each workload's kept bytes (its byte cap checked per batch)

Revision ID: 0032
Revises: 0031
Create Date: 2026-11-27 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workload_logs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("workload_id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("replica", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["workload_id"],
            ["workloads.id"],
            name=op.f("fk_workload_logs_workload_id_workloads"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_workload_logs_tenant_id_tenants"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workload_logs")),
        sa.UniqueConstraint(
            "workload_id",
            "attempt",
            "replica",
            "offset",
            name=op.f("uq_workload_logs_workload_id_attempt_replica_offset"),
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_workload_logs_workload_id_id", "workload_logs", ["workload_id", "id"], unique=False
    )
    op.create_index(
        op.f("ix_workload_logs_received_at"), "workload_logs", ["received_at"], unique=False
    )
    op.create_table(
        "workload_log_sizes",
        sa.Column("workload_id", sa.Uuid(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("dropped_below", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["workload_id"],
            ["workloads.id"],
            name=op.f("fk_workload_log_sizes_workload_id_workloads"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("workload_id", name=op.f("pk_workload_log_sizes")),
    )


def downgrade() -> None:
    op.drop_table("workload_log_sizes")
    op.drop_index(op.f("ix_workload_logs_received_at"), table_name="workload_logs")
    op.drop_index("ix_workload_logs_workload_id_id", table_name="workload_logs")
    op.drop_table("workload_logs")
