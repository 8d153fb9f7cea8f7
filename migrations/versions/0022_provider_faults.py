"""The simulated provider's injected faults (chaos: boots or repairs that fail)

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-25 08:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sim_provider_faults",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("node", sa.String(length=63), nullable=False),
        sa.Column("fails", sa.String(length=8), nullable=False),
        sa.Column("source", sa.Uuid(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sim_provider_faults")),
    )
    op.create_index(
        op.f("ix_sim_provider_faults_node"), "sim_provider_faults", ["node"], unique=False
    )
    op.create_index(
        op.f("ix_sim_provider_faults_source"), "sim_provider_faults", ["source"], unique=False
    )
    op.add_column("chaos_injections", sa.Column("detail", sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column("chaos_injections", "detail")
    op.drop_index(op.f("ix_sim_provider_faults_source"), table_name="sim_provider_faults")
    op.drop_index(op.f("ix_sim_provider_faults_node"), table_name="sim_provider_faults")
    op.drop_table("sim_provider_faults")
