"""Node agents run work: the agent's node record and desired-state index, what a workload runs
(command, env, runtime, checkpoint signal and location), and each replica's process as reported

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-26 12:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def _workload_columns() -> list[sa.Column]:
    return [
        sa.Column("command", sa.JSON(), nullable=True),
        sa.Column("env", sa.JSON(), server_default="{}", nullable=False),
        sa.Column("runtime", sa.String(length=16), server_default="process", nullable=False),
        sa.Column(
            "checkpoint_signal", sa.String(length=12), server_default="SIGUSR1", nullable=False
        ),
        sa.Column("checkpoint_requests", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_checkpoint_uri", sa.String(length=2000), nullable=True),
        sa.Column("last_checkpoint_step", sa.BigInteger(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
    ]


def _allocation_columns() -> list[sa.Column]:
    return [
        sa.Column("run_state", sa.String(length=16), nullable=True),
        sa.Column("run_pid", sa.Integer(), nullable=True),
        sa.Column("run_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("run_ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("exit_code", sa.SmallInteger(), nullable=True),
        sa.Column("exit_signal", sa.String(length=16), nullable=True),
    ]


def upgrade() -> None:
    op.create_table(
        "agent_nodes",
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("node_name", sa.String(length=63), nullable=False),
        sa.Column("desired_index", sa.BigInteger(), server_default="1", nullable=False),
        sa.Column("address", sa.String(length=253), nullable=False),
        sa.Column("agent_version", sa.String(length=32), nullable=False),
        sa.Column("runtimes", sa.JSON(), nullable=False),
        sa.Column("inventory", sa.JSON(), nullable=False),
        sa.Column("differences", sa.JSON(), nullable=False),
        sa.Column("inventory_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_report_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_agent_nodes_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_agent_nodes")),
        sa.UniqueConstraint("node_name", name=op.f("uq_agent_nodes_node_name")),
    )
    for column in _workload_columns():
        op.add_column("workloads", column)
    for column in _allocation_columns():
        op.add_column("allocations", column)


def downgrade() -> None:
    for column in reversed(_allocation_columns()):
        op.drop_column("allocations", column.name)
    for column in reversed(_workload_columns()):
        op.drop_column("workloads", column.name)
    op.drop_table("agent_nodes")
