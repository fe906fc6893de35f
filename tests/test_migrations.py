"""The catalog schema: created at head, checked on open, upgraded by `ckstore db upgrade`."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from alembic import command
from alembic.config import Config
from click.testing import CliRunner

import ckstore
from ckstore.catalog._engine import head_revision, migrations_dir
from ckstore.cli import main


def _cfg(db: Path) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", f"sqlite:///{db}")
    return cfg


def test_fresh_catalog_is_stamped_at_head(store_path: Path) -> None:
    s = ckstore.open(store_path)
    with s.catalog.engine.connect() as conn:
        rev = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
    assert rev == head_revision(s.catalog.engine)


def test_migrations_build_the_same_schema_as_the_models(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    command.upgrade(_cfg(db), "head")
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from ckstore.catalog._schema import Base

    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_outdated_catalog_names_the_upgrade_command(store_path: Path) -> None:
    s = ckstore.open(store_path, run="r")
    s.commit(1, {0: {"m": {"w": torch.ones(2)}}})
    s.close()
    db = store_path / "catalog.db"
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0000'"))
    with pytest.raises(ckstore.SchemaVersionError, match="newer ckstore"):
        ckstore.open(store_path)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM alembic_version"))
    with pytest.raises(ckstore.SchemaVersionError, match=rf"ckstore --store {store_path} db upgrade"):
        ckstore.open(store_path)


def test_db_upgrade_from_base(tmp_path: Path) -> None:
    store_path = tmp_path / "s"
    ckstore.open(store_path).close()
    db = store_path / "catalog.db"
    command.downgrade(_cfg(db), "base")
    with pytest.raises(ckstore.SchemaVersionError):
        ckstore.open(store_path)
    res = CliRunner().invoke(main, ["--store", str(store_path), "db", "upgrade"])
    assert res.exit_code == 0, res.output
    assert "upgraded" in res.output
    s = ckstore.open(store_path, run="r")
    s.commit(1, {0: {"m": {"w": torch.ones(2)}}})
    res = CliRunner().invoke(main, ["--store", str(store_path), "db", "upgrade"])
    assert "already at schema revision" in res.output
