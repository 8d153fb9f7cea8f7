"""Tenants' SSH public keys, for the instances they launch (never a private key)

Revision ID: 0041
Revises: 0040
Create Date: 2026-11-28 03:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0041"
down_revision = "0040"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ssh_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("key_type", sa.String(length=32), nullable=False),
        sa.Column("bits", sa.Integer(), nullable=False),
        sa.Column("public_key", sa.String(length=4096), nullable=False),
        sa.Column("comment", sa.String(length=255), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_ssh_keys_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_ssh_keys"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_ssh_keys_tenant_id_name"),
        sa.UniqueConstraint("tenant_id", "fingerprint", name="uq_ssh_keys_tenant_id_fingerprint"),
    )
    op.create_index("ix_ssh_keys_created_at", "ssh_keys", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_ssh_keys_created_at", table_name="ssh_keys")
    op.drop_table("ssh_keys")
