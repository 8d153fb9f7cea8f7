"""chaos experiments

Experiments (their spec, state and how many GPUs they may take out) and the faults each
injected through the telemetry path, with when they were undone.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-25 06:25:13.177988
"""
from alembic import op
import sqlalchemy as sa


revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('chaos_experiments',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('state', sa.String(length=12), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('gpus_touched', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_chaos_experiments'))
    )
    op.create_index(op.f('ix_chaos_experiments_created_at'), 'chaos_experiments', ['created_at'], unique=False)
    op.create_table('chaos_injections',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('experiment_id', sa.Uuid(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('code', sa.Integer(), nullable=True),
    sa.Column('node_id', sa.Uuid(), nullable=False),
    sa.Column('node', sa.String(length=63), nullable=False),
    sa.Column('gpu_index', sa.SmallInteger(), nullable=True),
    sa.Column('injected_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('undone_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['experiment_id'], ['chaos_experiments.id'], name=op.f('fk_chaos_injections_experiment_id_chaos_experiments'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_chaos_injections_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_chaos_injections'))
    )
    op.create_index(op.f('ix_chaos_injections_experiment_id'), 'chaos_injections', ['experiment_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_chaos_injections_experiment_id'), table_name='chaos_injections')
    op.drop_table('chaos_injections')
    op.drop_index(op.f('ix_chaos_experiments_created_at'), table_name='chaos_experiments')
    op.drop_table('chaos_experiments')
