from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from app.models import Base
from tests.fixtures.harness import RUN_ID, create_database, drop_database


def _upgrade(url: str, target: str = "head", downgrade: bool = False) -> None:
    from alembic import command
    from alembic.config import Config

    from app.cli import ROOT

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.attributes["url"] = url.replace("postgresql://", "postgresql+psycopg://")
    (command.downgrade if downgrade else command.upgrade)(cfg, target)


def test_upgrade_head_on_empty_database_matches_models():
    name = f"rackplane_mig_{RUN_ID}"
    url = create_database(name)
    try:
        _upgrade(url)
        engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models and migrations differ; write a migration: {diff}"
        # And the migrations run backwards and forwards cleanly.
        _upgrade(url, "base", downgrade=True)
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
        _upgrade(url)
        engine.dispose()
    finally:
        drop_database(name)
