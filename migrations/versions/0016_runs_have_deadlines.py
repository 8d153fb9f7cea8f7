"""runs have deadlines

A run of a workload ends at the latest at `run_deadline_at` (its max_runtime_s, or the length
a simulated run declared in `run_for_s`); `workloads.expire` stops it then and the reconciler
finds the deadlines a lost message missed, through a partial index of running work.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-25 03:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workloads', sa.Column('run_for_s', sa.Integer(), nullable=True))
    op.add_column('workloads', sa.Column('run_started_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('workloads', sa.Column('run_deadline_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_workloads_run_deadline', 'workloads', ['run_deadline_at'], unique=False, postgresql_where=sa.text("state = 'running'"), sqlite_where=sa.text("state = 'running'"))


def downgrade() -> None:
    op.drop_index('ix_workloads_run_deadline', table_name='workloads', postgresql_where=sa.text("state = 'running'"), sqlite_where=sa.text("state = 'running'"))
    op.drop_column('workloads', 'run_deadline_at')
    op.drop_column('workloads', 'run_started_at')
    op.drop_column('workloads', 'run_for_s')
