"""an append-only audit log

One row per mutating request and per automatic action (app/audit). The database itself refuses
UPDATE and DELETE of its rows (a trigger on PostgreSQL and on SQLite), so no code path of the
application can rewrite history; retention, when it comes, is an operator's partition drop.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25 03:10:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'audit_log',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('principal', sa.String(length=16), nullable=False),
        sa.Column('key_id', sa.Uuid(), nullable=True),
        sa.Column('key_prefix', sa.String(length=16), nullable=True),
        sa.Column('tenant_id', sa.Uuid(), nullable=True),
        sa.Column('action', sa.String(length=120), nullable=False),
        sa.Column('target_type', sa.String(length=32), nullable=True),
        sa.Column('target_id', sa.String(length=64), nullable=True),
        sa.Column('request_id', sa.String(length=128), nullable=True),
        sa.Column('status', sa.SmallInteger(), nullable=True),
        sa.Column('details', sa.JSON(), nullable=False),
        sa.Column('internal', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_audit_log_tenant_id_tenants'), ondelete='RESTRICT'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_log')),
    )
    op.create_index('ix_audit_log_created', 'audit_log', ['created_at', 'id'], unique=False)
    op.create_index('ix_audit_log_tenant_created', 'audit_log', ['tenant_id', 'created_at', 'id'], unique=False)
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(
            """
            CREATE FUNCTION audit_log_append_only() RETURNS trigger AS $$
            BEGIN
                RAISE EXCEPTION 'audit_log is append-only: % refused', TG_OP
                    USING ERRCODE = 'insufficient_privilege';
            END;
            $$ LANGUAGE plpgsql
            """
        )
        op.execute(
            "CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log "
            "FOR EACH ROW EXECUTE FUNCTION audit_log_append_only()"
        )
    else:
        for verb in ('UPDATE', 'DELETE'):
            op.execute(
                f"CREATE TRIGGER audit_log_no_{verb.lower()} BEFORE {verb} ON audit_log "
                f"BEGIN SELECT RAISE(ABORT, 'audit_log is append-only: {verb} refused'); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute("DROP TRIGGER IF EXISTS audit_log_append_only ON audit_log")
        op.execute("DROP FUNCTION IF EXISTS audit_log_append_only()")
    op.drop_index('ix_audit_log_tenant_created', table_name='audit_log')
    op.drop_index('ix_audit_log_created', table_name='audit_log')
    op.drop_table('audit_log')
