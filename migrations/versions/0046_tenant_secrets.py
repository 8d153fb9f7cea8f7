"""Tenant secrets (sealed at rest) and workloads' env variables that name them

Revision ID: 0046
Revises: 0045
Create Date: 2026-11-29 10:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0046"
down_revision = "0045"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_secrets",
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column(
            "tenant_id", sa.Uuid(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("sealed", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_index("ix_tenant_secrets_created_at", "tenant_secrets", ["created_at"])
    op.add_column(
        "workloads", sa.Column("secret_env", sa.JSON(), server_default="{}", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("workloads", "secret_env")
    op.drop_index("ix_tenant_secrets_created_at", table_name="tenant_secrets")
    op.drop_table("tenant_secrets")
