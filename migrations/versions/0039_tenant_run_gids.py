"""Each tenant has a group id of its own on every node: its runs (each its own uid) share
their files through it, never with another tenant's

Revision ID: 0039
Revises: 0038
Create Date: 2026-11-28 02:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None

BASE = 3_000_000  # app.models.tenants.RUN_GID_BASE at the time of writing


def upgrade() -> None:
    op.add_column("tenants", sa.Column("run_gid", sa.Integer(), nullable=True))
    tenants = sa.table("tenants", sa.column("id"), sa.column("run_gid"), sa.column("created_at"))
    bind = op.get_bind()
    ids = bind.execute(sa.select(tenants.c.id).order_by(tenants.c.created_at, tenants.c.id))
    for n, (tid,) in enumerate(ids.all()):
        bind.execute(tenants.update().where(tenants.c.id == tid).values(run_gid=BASE + n))
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("run_gid", existing_type=sa.Integer(), nullable=False)
        batch.create_unique_constraint("uq_tenants_run_gid", ["run_gid"])


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint("uq_tenants_run_gid", type_="unique")
        batch.drop_column("run_gid")
