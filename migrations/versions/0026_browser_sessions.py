"""Portal sign-ins: browser sessions (only the token's HMAC is stored)

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-25 13:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "browser_sessions",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=True),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("user_agent", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    for col in ("key_id", "tenant_id", "expires_at", "created_at"):
        op.create_index(f"ix_browser_sessions_{col}", "browser_sessions", [col], unique=False)


def downgrade() -> None:
    for col in ("key_id", "tenant_id", "expires_at", "created_at"):
        op.drop_index(f"ix_browser_sessions_{col}", table_name="browser_sessions")
    op.drop_table("browser_sessions")
