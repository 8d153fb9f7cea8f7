"""Where a workload's command starts (`workdir`)

Revision ID: 0047
Revises: 0046
Create Date: 2026-11-29 10:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0047"
down_revision = "0046"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workloads", sa.Column("workdir", sa.String(length=255), nullable=True))


def downgrade() -> None:
    op.drop_column("workloads", "workdir")
