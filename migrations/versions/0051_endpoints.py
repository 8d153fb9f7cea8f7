"""Inference endpoints, their scaling decisions, and where each replica serves (issue 47)

Revision ID: 0051
Revises: 0050
Create Date: 2026-11-29 20:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0051"
down_revision = "0050"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoints",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column(
            "tenant_id", sa.Uuid(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("replica", sa.JSON(), nullable=False),
        sa.Column("region", sa.String(63), nullable=True),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("ready_path", sa.String(200), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("slo_kind", sa.String(8), nullable=False),
        sa.Column("slo_ms", sa.Integer(), nullable=False),
        sa.Column("signal", sa.String(16), nullable=False),
        sa.Column("signal_target", sa.Float(), nullable=False),
        sa.Column("target", sa.Integer(), nullable=False),
        sa.Column("target_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("scaler_memory", sa.JSON(), nullable=False),
        sa.Column("replicas_made", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_index("ix_endpoints_created_at", "endpoints", ["created_at"])
    op.create_table(
        "endpoint_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column(
            "endpoint_id",
            sa.Uuid(),
            sa.ForeignKey("endpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "tenant_id", sa.Uuid(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("target", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
    )
    op.create_index("ix_endpoint_events_endpoint_id", "endpoint_events", ["endpoint_id"])
    op.create_table(
        "endpoint_samples",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column(
            "endpoint_id",
            sa.Uuid(),
            sa.ForeignKey("endpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("gateway", sa.String(64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_flight", sa.Float(), nullable=False),
        sa.Column("arrivals", sa.Integer(), nullable=False),
        sa.Column("p95_ms", sa.Float(), nullable=True),
    )
    op.create_index("ix_endpoint_samples_endpoint_id", "endpoint_samples", ["endpoint_id"])
    op.create_index("ix_endpoint_samples_at", "endpoint_samples", ["at"])
    op.add_column("workloads", sa.Column("endpoint_id", sa.Uuid(), nullable=True))
    op.add_column("workloads", sa.Column("serve_host", sa.String(253), nullable=True))
    op.add_column("workloads", sa.Column("serve_port", sa.Integer(), nullable=True))
    op.add_column(
        "workloads", sa.Column("serve_ready_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.create_index("ix_workloads_endpoint_id", "workloads", ["endpoint_id"])
    if op.get_bind().dialect.name != "sqlite":  # SQLite cannot add a constraint in place
        op.create_foreign_key(
            "fk_workloads_endpoint_id",
            "workloads",
            "endpoints",
            ["endpoint_id"],
            ["id"],
            ondelete="SET NULL",
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_workloads_endpoint_id", "workloads", type_="foreignkey")
    op.drop_index("ix_workloads_endpoint_id", table_name="workloads")
    for column in ("serve_ready_at", "serve_port", "serve_host", "endpoint_id"):
        op.drop_column("workloads", column)
    op.drop_index("ix_endpoint_samples_at", table_name="endpoint_samples")
    op.drop_index("ix_endpoint_samples_endpoint_id", table_name="endpoint_samples")
    op.drop_table("endpoint_samples")
    op.drop_index("ix_endpoint_events_endpoint_id", table_name="endpoint_events")
    op.drop_table("endpoint_events")
    op.drop_index("ix_endpoints_created_at", table_name="endpoints")
    op.drop_table("endpoints")
