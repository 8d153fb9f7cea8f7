"""the GPU health loop

GPUs and nodes carry a health state (app/health/states.py) with its reason and start; GPUs a
DCGM UUID and a measured performance score. New tables keep heartbeats and per-GPU telemetry
aggregates (apart from nodes/gpus, whose writes bump the fleet version), incidents, the history
of health transitions and repairs. Workloads carry their interruptions and lost work, whether
they are requeued ahead of their peers, and whether they move at their next checkpoint.
GPU health values before: healthy, degraded, failed; now degraded is suspect and failed is
out_of_service.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-25 04:40:37.435558
"""
from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('health_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('node_id', sa.Uuid(), nullable=False),
    sa.Column('gpu_index', sa.SmallInteger(), nullable=True),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('rack', sa.String(length=63), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=False),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('actor', sa.String(length=8), nullable=False),
    sa.Column('cause', sa.String(length=500), nullable=False),
    sa.Column('incident_id', sa.Uuid(), nullable=True),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.Column('taken_out', sa.SmallInteger(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_health_events_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_health_events'))
    )
    op.create_index(op.f('ix_health_events_at'), 'health_events', ['at'], unique=False)
    op.create_index('ix_health_events_node_at', 'health_events', ['node_id', 'at'], unique=False)
    op.create_table('health_incidents',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('node_id', sa.Uuid(), nullable=False),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('state', sa.String(length=8), nullable=False),
    sa.Column('opened_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_signal_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('signal', sa.String(length=32), nullable=False),
    sa.Column('code', sa.Integer(), nullable=True),
    sa.Column('action', sa.String(length=24), nullable=False),
    sa.Column('what', sa.String(length=300), nullable=False),
    sa.Column('scope', sa.String(length=8), nullable=False),
    sa.Column('repair', sa.String(length=8), nullable=False),
    sa.Column('gpu_indices', sa.JSON(), nullable=False),
    sa.Column('signals', sa.JSON(), nullable=False),
    sa.Column('signal_count', sa.Integer(), nullable=False),
    sa.Column('held_back', sa.String(length=300), nullable=True),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_health_incidents_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_health_incidents'))
    )
    op.create_index('ix_health_incidents_open', 'health_incidents', ['node_id'], unique=False, postgresql_where=sa.text("state = 'open'"), sqlite_where=sa.text("state = 'open'"))
    op.create_index(op.f('ix_health_incidents_opened_at'), 'health_incidents', ['opened_at'], unique=False)
    op.create_index(op.f('ix_health_incidents_region'), 'health_incidents', ['region'], unique=False)
    op.create_table('health_repairs',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('node_id', sa.Uuid(), nullable=False),
    sa.Column('gpu_index', sa.SmallInteger(), nullable=True),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('incident_id', sa.Uuid(), nullable=True),
    sa.Column('gpu_indices', sa.JSON(), nullable=False),
    sa.Column('phase', sa.String(length=12), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('due_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('outcome', sa.String(length=16), nullable=True),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_health_repairs_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_health_repairs'))
    )
    op.create_index('ix_health_repairs_pending', 'health_repairs', ['due_at'], unique=False, postgresql_where=sa.text('finished_at IS NULL'), sqlite_where=sa.text('finished_at IS NULL'))
    op.create_table('idle_iron',
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('gpu_model', sa.String(length=32), nullable=False),
    sa.Column('gpu_seconds', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('region', 'gpu_model', name=op.f('pk_idle_iron'))
    )
    op.create_table('node_heartbeats',
    sa.Column('node_id', sa.Uuid(), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_node_heartbeats_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('node_id', name=op.f('pk_node_heartbeats'))
    )
    op.create_index(op.f('ix_node_heartbeats_last_seen_at'), 'node_heartbeats', ['last_seen_at'], unique=False)
    op.create_table('gpu_telemetry',
    sa.Column('gpu_id', sa.Uuid(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_xid', sa.Integer(), nullable=False),
    sa.Column('last_recovery_action', sa.Integer(), nullable=False),
    sa.Column('counters', sa.JSON(), nullable=False),
    sa.Column('latest', sa.JSON(), nullable=False),
    sa.Column('clock_ratio', sa.Float(), nullable=True),
    sa.Column('throttled', sa.Float(), nullable=True),
    sa.Column('samples', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['gpu_id'], ['gpus.id'], name=op.f('fk_gpu_telemetry_gpu_id_gpus'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('gpu_id', name=op.f('pk_gpu_telemetry'))
    )
    op.add_column('gpus', sa.Column('health_reason', sa.String(length=500), nullable=True))
    op.add_column('gpus', sa.Column('health_since', sa.DateTime(timezone=True), nullable=True))
    op.add_column('gpus', sa.Column('uuid', sa.String(length=64), nullable=True))
    op.add_column('gpus', sa.Column('perf', sa.Float(), server_default='1', nullable=False))
    op.add_column('gpus', sa.Column('perf_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f('ix_gpus_uuid'), 'gpus', ['uuid'], unique=True)
    op.execute("UPDATE gpus SET health = 'suspect' WHERE health = 'degraded'")
    op.execute("UPDATE gpus SET health = 'out_of_service' WHERE health = 'failed'")
    op.add_column('nodes', sa.Column('health', sa.String(length=16), server_default='healthy', nullable=False))
    op.add_column('nodes', sa.Column('health_reason', sa.String(length=500), nullable=True))
    op.add_column('nodes', sa.Column('health_since', sa.DateTime(timezone=True), nullable=True))
    op.add_column('workloads', sa.Column('interruptions', sa.Integer(), server_default='0', nullable=False))
    op.add_column('workloads', sa.Column('lost_work_gpu_s', sa.Float(), server_default='0', nullable=False))
    op.add_column('workloads', sa.Column('expedited', sa.Boolean(), server_default=sa.text('false'), nullable=False))
    op.add_column('workloads', sa.Column('migrate_at_checkpoint', sa.Boolean(), server_default=sa.text('false'), nullable=False))


def downgrade() -> None:
    op.drop_column('workloads', 'migrate_at_checkpoint')
    op.drop_column('workloads', 'expedited')
    op.drop_column('workloads', 'lost_work_gpu_s')
    op.drop_column('workloads', 'interruptions')
    op.drop_column('nodes', 'health_since')
    op.drop_column('nodes', 'health_reason')
    op.drop_column('nodes', 'health')
    op.drop_index(op.f('ix_gpus_uuid'), table_name='gpus')
    op.execute("UPDATE gpus SET health = 'degraded' WHERE health = 'suspect'")
    op.execute("UPDATE gpus SET health = 'failed' WHERE health <> 'healthy' AND health <> 'degraded'")
    op.drop_column('gpus', 'perf_at')
    op.drop_column('gpus', 'perf')
    op.drop_column('gpus', 'uuid')
    op.drop_column('gpus', 'health_since')
    op.drop_column('gpus', 'health_reason')
    op.drop_table('gpu_telemetry')
    op.drop_table('idle_iron')
    op.drop_index(op.f('ix_node_heartbeats_last_seen_at'), table_name='node_heartbeats')
    op.drop_table('node_heartbeats')
    op.drop_index('ix_health_repairs_pending', table_name='health_repairs', postgresql_where=sa.text('finished_at IS NULL'), sqlite_where=sa.text('finished_at IS NULL'))
    op.drop_table('health_repairs')
    op.drop_index(op.f('ix_health_incidents_region'), table_name='health_incidents')
    op.drop_index(op.f('ix_health_incidents_opened_at'), table_name='health_incidents')
    op.drop_index('ix_health_incidents_open', table_name='health_incidents', postgresql_where=sa.text("state = 'open'"), sqlite_where=sa.text("state = 'open'"))
    op.drop_table('health_incidents')
    op.drop_index('ix_health_events_node_at', table_name='health_events')
    op.drop_index(op.f('ix_health_events_at'), table_name='health_events')
    op.drop_table('health_events')
