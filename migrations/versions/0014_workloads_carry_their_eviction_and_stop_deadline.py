"""workloads carry their eviction time and stop deadline

`workloads.provision` starts nothing on a GPU whose previous holder is still inside its
checkpoint grace: it finds those holders by their released allocations (released at
`evicted_at`) and waits until they stop or `stop_deadline` passes.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25 03:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workloads', sa.Column('evicted_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('workloads', sa.Column('stop_deadline', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('workloads', 'stop_deadline')
    op.drop_column('workloads', 'evicted_at')
