"""chaos experiments say why they were aborted

An experiment stopped by one of its abort conditions (too many failed workloads, too little idle
capacity) is `aborted`, with the condition in words.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-25 06:52:16.654447
"""
from alembic import op
import sqlalchemy as sa


revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('chaos_experiments', sa.Column('abort_reason', sa.String(length=300), nullable=True))


def downgrade() -> None:
    op.drop_column('chaos_experiments', 'abort_reason')
