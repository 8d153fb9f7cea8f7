"""placement cycle durations per region

Each placement cycle adds its duration to its region's cumulative histogram (one counter per
bucket), in its own transaction: /metrics shows every worker's cycles.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-25 06:01:17.438216
"""
from alembic import op
import sqlalchemy as sa


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('placement_cycle_stats',
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('cycles', sa.BigInteger(), nullable=False),
    sa.Column('seconds_sum', sa.Float(), nullable=False),
    sa.Column('le_0_005', sa.BigInteger(), nullable=False),
    sa.Column('le_0_01', sa.BigInteger(), nullable=False),
    sa.Column('le_0_025', sa.BigInteger(), nullable=False),
    sa.Column('le_0_05', sa.BigInteger(), nullable=False),
    sa.Column('le_0_1', sa.BigInteger(), nullable=False),
    sa.Column('le_0_25', sa.BigInteger(), nullable=False),
    sa.Column('le_0_5', sa.BigInteger(), nullable=False),
    sa.Column('le_1', sa.BigInteger(), nullable=False),
    sa.Column('le_2_5', sa.BigInteger(), nullable=False),
    sa.Column('le_5', sa.BigInteger(), nullable=False),
    sa.Column('le_10', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('region', name=op.f('pk_placement_cycle_stats'))
    )


def downgrade() -> None:
    op.drop_table('placement_cycle_stats')
